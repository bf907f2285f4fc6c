//! The ternary code of an exported weight: `t ∈ {−1, 0, +1}` stored as `t + 1` in bits
//! `2i .. 2i + 2` of word `i / 16` of its row (16 weights per `u32` word, rows padded to whole
//! words): 0.25 byte per weight. The host side here, the kernels' side in [`cube`].

/// Bits of one weight.
pub const TERNARY_BITS: usize = 2;
/// The bits of one weight, as a mask.
pub const TERNARY_MASK: u32 = (1 << TERNARY_BITS) - 1;
/// Weights per `u32` word.
pub const TERNARIES_PER_WORD: usize = 32 / TERNARY_BITS;

/// Words that hold a row of `n_in` ternaries.
pub fn words_per_row(n_in: usize) -> usize {
    n_in.div_ceil(TERNARIES_PER_WORD)
}

/// Writes `t` (in `−1..=1`) as weight `i` of a packed row whose words are still zero there.
pub fn set_ternary(words: &mut [u32], i: usize, t: i32) {
    debug_assert!((-1..=1).contains(&t), "ternary {t}");
    words[i / TERNARIES_PER_WORD] |= ((t + 1) as u32) << shift(i);
}

/// `t` of weight `i` of a packed row.
pub fn ternary_at(words: &[u32], i: usize) -> i32 {
    ((words[i / TERNARIES_PER_WORD] >> shift(i)) & TERNARY_MASK) as i32 - 1
}

fn shift(i: usize) -> usize {
    TERNARY_BITS * (i % TERNARIES_PER_WORD)
}

/// `scale · t` of the row packed in `words`, into `out` (`[n_in]`), a word at a time.
pub fn decode_row(words: &[u32], scale: f32, out: &mut [f32]) {
    // `t + 1` indexes the table; the fourth value is never stored.
    let values = [-scale, 0.0, scale, scale];
    for (group, word) in out.chunks_mut(TERNARIES_PER_WORD).zip(words) {
        for (k, w) in group.iter_mut().enumerate() {
            *w = values[((word >> (TERNARY_BITS * k)) & TERNARY_MASK) as usize];
        }
    }
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The ternary code on a device.

    use cubecl::prelude::*;

    use super::{TERNARIES_PER_WORD, TERNARY_BITS, TERNARY_MASK};

    /// `t + 1` of weight `i` of the row whose words start at `base` ([`crate::ternary::ternary_at`]).
    #[cube]
    pub fn ternary_plus_one_at(codes: &Tensor<u32>, base: usize, i: u32) -> u32 {
        let word = codes[base + usize::cast_from(i / TERNARIES_PER_WORD as u32)];
        (word >> ((i % TERNARIES_PER_WORD as u32) * TERNARY_BITS as u32)) & TERNARY_MASK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs by writing each weight's two bits one at a time, least significant first.
    fn reference_pack(ternaries: &[i32]) -> Vec<u32> {
        let mut words = vec![0u32; ternaries.len().div_ceil(16)];
        for (i, t) in ternaries.iter().enumerate() {
            let stored = (t + 1) as u32;
            for b in 0..2 {
                let bit = 2 * i + b;
                words[bit / 32] |= ((stored >> b) & 1) << (bit % 32);
            }
        }
        words
    }

    #[test]
    fn packing_matches_a_bitwise_packer_and_decodes() {
        for n_in in [1, 15, 16, 17, 40] {
            let ternaries: Vec<i32> = (0..n_in).map(|i| (i as i32 * 7 + 2) % 3 - 1).collect();
            let mut words = vec![0u32; words_per_row(n_in)];
            for (i, t) in ternaries.iter().enumerate() {
                set_ternary(&mut words, i, *t);
            }
            assert_eq!(words, reference_pack(&ternaries), "n_in {n_in}");
            let read: Vec<i32> = (0..n_in).map(|i| ternary_at(&words, i)).collect();
            assert_eq!(read, ternaries, "n_in {n_in}");
            let mut dense = vec![f32::NAN; n_in];
            decode_row(&words, 0.5, &mut dense);
            let want: Vec<f32> = ternaries.iter().map(|t| 0.5 * *t as f32).collect();
            assert_eq!(dense, want, "n_in {n_in}");
        }
    }
}
