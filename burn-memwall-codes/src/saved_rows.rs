//! The code of an activation kept for a backward pass in 8 or 4 bits per value: each row's
//! values in steps of the row's scale (`max |x| / limit`), rounded stochastically to the codes
//! `−limit..=limit` (`E[code · scale] = x`), each row packed as [`crate::packing`] says, as
//! `code + 2^(bits − 1)` (so every field is unsigned). The host side here, the kernels' side in
//! [`cube`].

pub use crate::packing::lanes;
use crate::packing::{field_at, words_for};

/// The widths a code can have: 8 bits (codes `−127..=127`) or 4 (`−7..=7`).
pub const CODE_BITS: [u32; 2] = [8, 4];

/// The largest code at `bits`: the scale of a row is its largest magnitude over it.
pub const fn limit(bits: u32) -> u32 {
    (1 << (bits - 1)) - 1
}

/// Words that hold a row of `width` values.
pub fn words_per_row(width: usize, bits: u32) -> usize {
    words_for(width, bits)
}

/// The field of `x` in steps of `scale`, with `u` uniform in `[0, 1)`: `⌊x / scale + u⌋`, which
/// is `⌈x / scale⌉` with probability `x / scale − ⌊x / scale⌋` and so `x / scale` in expectation,
/// plus the offset `2^(bits − 1)`. The clamp only catches a quotient rounded past the limit.
pub fn field(x: f32, scale: f32, u: f32, bits: u32) -> u32 {
    let limit = limit(bits) as f32;
    let code = (x / scale + u).floor().clamp(-limit, limit);
    (code as i32 + (1 << (bits - 1))) as u32
}

/// The code in lane `lane` of `word`.
pub fn code_at(word: u32, lane: u32, bits: u32) -> i32 {
    field_at(word, lane, bits) as i32 - (1 << (bits - 1))
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The code on a device.

    use cubecl::prelude::*;

    use super::limit;
    use crate::packing::cube::field_at;

    /// [`super::field`].
    #[cube]
    pub fn field(x: f32, scale: f32, u: f32, #[comptime] bits: u32) -> u32 {
        let largest = comptime!(limit(bits)) as f32;
        let code = f32::clamp(f32::floor(x / scale + u), -largest, largest);
        u32::cast_from(i32::cast_from(code) + comptime!(1i32 << (bits - 1)))
    }

    /// [`super::code_at`].
    #[cube]
    pub fn code_at(word: u32, lane: u32, #[comptime] bits: u32) -> i32 {
        i32::cast_from(field_at(word, lane, bits)) - comptime!(1i32 << (bits - 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code survives its field, in every lane, at both widths; the fields of one word do
    /// not overlap.
    #[test]
    fn codes_round_trip_in_every_lane() {
        for bits in CODE_BITS {
            let limit = limit(bits) as i32;
            for code in -limit..=limit {
                // A value exactly on a step rounds to it whatever the draw.
                let field = field(code as f32 * 0.5, 0.5, 0.999, bits);
                for lane in 0..lanes(bits) {
                    let neighbours = (0..lanes(bits))
                        .filter(|&other| other != lane)
                        .fold(0, |word, other| word | (field << (bits * other)));
                    let word = neighbours | (field << (bits * lane));
                    assert_eq!(code_at(word, lane, bits), code, "{bits} bits, lane {lane}");
                }
            }
        }
    }

    /// A value between two steps becomes the upper one exactly when the draw falls below its
    /// distance above the lower one; beyond the limit, the limit.
    #[test]
    fn the_draw_decides_between_the_two_neighbouring_steps() {
        let code = |x, u| code_at(field(x, 1.0, u, 8), 0, 8);
        assert_eq!((code(2.25, 0.74), code(2.25, 0.76)), (2, 3));
        assert_eq!((code(-2.25, 0.24), code(-2.25, 0.26)), (-3, -2));
        assert_eq!((code(127.5, 0.9), code(-127.5, 0.0)), (127, -127));
    }
}
