//! How codes of `bits` bits (8 or 4) are packed into `u32` words: `32 / bits` to a word, value
//! `i` of a run in lane `i % lanes` of word `i / lanes`, at bits `bits·lane..bits·(lane + 1)`;
//! a run is padded to whole words. Shared by [`crate::saved_rows`] and [`crate::moments`].

/// Values per `u32` word at `bits` per code.
pub const fn lanes(bits: u32) -> u32 {
    32 / bits
}

/// Words that hold `values` codes of `bits` bits.
pub fn words_for(values: usize, bits: u32) -> usize {
    values.div_ceil(lanes(bits) as usize)
}

/// The field in lane `lane` of `word`.
pub fn field_at(word: u32, lane: u32, bits: u32) -> u32 {
    (word >> (bits * lane)) & ((1 << bits) - 1)
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The packing on a device.

    use cubecl::prelude::*;

    /// [`super::field_at`].
    #[cube]
    pub fn field_at(word: u32, lane: u32, #[comptime] bits: u32) -> u32 {
        (word >> (lane * bits)) & comptime!((1u32 << bits) - 1)
    }
}
