//! AdamW's two moments kept in 8 or 4 bits per value: block-wise dynamic quantisation, as
//! bitsandbytes' 8-bit optimizers (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
//! Quantization", §2) and torchao's low-bit optimizers keep them.
//!
//! A moment is cut into blocks of [`block_size`] consecutive values (the last one may be
//! short). Each block keeps one f32 scale, its largest magnitude (at least [`MIN_SCALE`]), and
//! each value the index of the entry of a fixed, increasing table nearest to `value / scale`
//! (a tie goes up). The codes are packed as [`crate::packing`] says. The tables ([`table`]):
//!
//! - 8 bits, both moments: the *dynamic tree* map (Dettmers 2016, "8-Bit Approximations for
//!   Parallelism in Deep Learning"), as `create_dynamic_map(signed, 7, 8)` of bitsandbytes and
//!   torchao builds it: for each exponent `e` in `−6..=0`, `2^(e + 6)` (signed) or `2^(e + 7)`
//!   (unsigned) values `10^e · m`, `m` the midpoints of an even split of `[0.1, 1]`, mirrored
//!   for the signed (first) moment, plus 0 and 1. Magnitudes from `5.5·10⁻⁷` to 1: the first
//!   moment's values span orders of magnitude inside one block.
//! - 4 bits, first moment: the same construction with 3 exponent bits (`e` in `−2..=0`).
//! - 4 bits, second moment: linear, `k / 16` for `k` in `1..=16`, with no zero: a second
//!   moment rounded to 0 under a first that is not divides the update by `ε` alone (Li et al.
//!   2023, "Memory Efficient Optimizers with 4-bit States", §4.1; torchao's choice too).
//!
//! The host side here (the reference the Flex path runs), the kernels' side in [`cube`].

use std::sync::OnceLock;

/// The widths a moment's code can have.
pub const MOMENT_BITS: [u32; 2] = [8, 4];

/// The smallest scale a block keeps: a block of zeros codes as zeros (or, in the 4-bit second
/// moment's table, as `scale / 16`, which is negligible under it).
pub const MIN_SCALE: f32 = 1e-12;

/// Which of AdamW's moments a table codes: the first is signed, the second never negative.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// `m`, the running mean of the gradient.
    First,
    /// `v`, the running mean of its square.
    Second,
}

/// The largest [`block_size`]: one block's values fit an array of this many.
pub const MAX_BLOCK_SIZE: usize = 256;

/// Values per block, each block with one scale: 256 at 8 bits, 128 at 4 (torchao's defaults; a
/// smaller block follows outliers closer where fewer codes have to cover the block's range).
///
/// # Panics
/// If `bits` is not one of [`MOMENT_BITS`].
pub fn block_size(bits: u32) -> usize {
    match bits {
        8 => MAX_BLOCK_SIZE,
        4 => 128,
        _ => panic!("moments are kept in 8 or 4 bits, not {bits}"),
    }
}

/// The table of `moment` at `bits`: `2^bits` increasing values in `[−1, 1]` (first moment) or
/// `[0, 1]` (second); a code is an index into it.
///
/// # Panics
/// If `bits` is not one of [`MOMENT_BITS`].
pub fn table(moment: Moment, bits: u32) -> &'static [f32] {
    coder(moment, bits).table()
}

/// The table of `moment` at `bits` and what finds a value's code in it on the host.
///
/// # Panics
/// If `bits` is not one of [`MOMENT_BITS`].
pub fn coder(moment: Moment, bits: u32) -> &'static Coder {
    static CODERS: OnceLock<[Coder; 4]> = OnceLock::new();
    let coders = CODERS.get_or_init(|| {
        [
            Coder::new(dynamic_map(true, 7, 8)),
            Coder::new(dynamic_map(false, 7, 8)),
            Coder::new(dynamic_map(true, 3, 4)),
            Coder::new((1..=16).map(|k| k as f32 / 16.0).collect()),
        ]
    });
    let at = match (bits, moment) {
        (8, Moment::First) => 0,
        (8, Moment::Second) => 1,
        (4, Moment::First) => 2,
        (4, Moment::Second) => 3,
        _ => panic!("moments are kept in 8 or 4 bits, not {bits}"),
    };
    &coders[at]
}

/// A table and, for each of the 2^16 ranges of f32 values that share their top 16 bits (in
/// the order of the values), the last code whose entry is at most the range's smallest value:
/// a value's code is there or one or two codes up (a range is 1/128 of its value wide, and no
/// range holds more than two entries: tested), found without a branch.
pub struct Coder {
    /// The table and two entries of +∞ after it, so that the steps up need no bound.
    padded: Vec<f32>,
    start: Vec<u8>,
}

impl Coder {
    fn new(table: Vec<f32>) -> Self {
        let start = (0..1u32 << 16)
            .map(|range| {
                let smallest = from_ordered(range << 16);
                // A range of NaNs (the ends of the order) starts at code 0.
                let at_most = table.partition_point(|&entry| entry <= smallest);
                at_most.saturating_sub(1) as u8
            })
            .collect();
        let padded = table.into_iter().chain([f32::INFINITY; 2]).collect();
        Self { padded, start }
    }

    /// The table: a code is an index into it.
    pub fn table(&self) -> &[f32] {
        &self.padded[..self.padded.len() - 2]
    }

    /// The code of `x` (a value divided by its block's scale): the index of the nearest entry, a
    /// tie going up. The last entry at most `x` (0 below the first), then a step up when `x` is
    /// past the midpoint to the next.
    pub fn encode(&self, x: f32) -> u32 {
        let t = &self.padded;
        let mut code = usize::from(self.start[(ordered(x) >> 16) as usize]);
        code += usize::from(t[code + 1] <= x);
        code += usize::from(t[code + 1] <= x);
        // Past the last entry the next is +∞: no step.
        code += usize::from(x - t[code] >= (t[code + 1] - t[code]) * 0.5);
        code as u32
    }
}

/// `x`'s bits as a key that orders as the values do (negative values below positive ones).
fn ordered(x: f32) -> u32 {
    let bits = x.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    }
}

/// The value whose [`ordered`] key is `key`.
fn from_ordered(key: u32) -> f32 {
    f32::from_bits(if key >> 31 == 1 {
        key & !(1 << 31)
    } else {
        !key
    })
}

/// The dynamic map of `total_bits` with up to `exponent_bits` exponent bits, as described in
/// the module's docs; computed in f64, kept in f32.
fn dynamic_map(signed: bool, exponent_bits: i32, total_bits: i32) -> Vec<f32> {
    let fraction_bits = total_bits - 1 - exponent_bits;
    let midpoints = |count: i32| {
        let step = 0.9 / count as f64;
        (0..count).map(move |k| 0.1 + step * (k as f64 + 0.5))
    };
    let mut map = vec![0.0, 1.0];
    for i in 0..exponent_bits {
        let count = 1 << (i + fraction_bits + i32::from(!signed));
        let magnitude = 10f64.powi(i - (exponent_bits - 1));
        for m in midpoints(count) {
            map.push(magnitude * m);
            if signed {
                map.push(-magnitude * m);
            }
        }
    }
    // The values a code has with all exponent bits zero, when fraction bits are left for them.
    let extra = (1 << fraction_bits) - 1;
    for m in midpoints(extra) {
        map.push(m);
        if signed {
            map.push(-m);
        }
    }
    assert_eq!(
        map.len(),
        1 << total_bits,
        "the dynamic map fills its codes"
    );
    map.sort_by(f64::total_cmp);
    map.into_iter().map(|v| v as f32).collect()
}

/// The scale a block of largest magnitude `largest` keeps.
pub fn block_scale(largest: f32) -> f32 {
    largest.max(MIN_SCALE)
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The code on a device, its table a tensor of the host's [`super::table`].

    use cubecl::prelude::*;

    /// [`super::Coder::encode`]'s code, by a binary search for the last entry at most `x`
    /// (0 below the first), then the step up past the midpoint.
    #[cube]
    pub fn encode(x: f32, table: &Tensor<f32>) -> u32 {
        let mut code = 0usize;
        // From the table's runtime length: CubeCL 0.11's IR verifier rejects a mutable variable
        // that starts from a comptime value.
        let mut step = table.len() / 2;
        while step > 0 {
            if x >= table[code + step] {
                code += step;
            }
            step /= 2;
        }
        let up = min(code + 1, table.len() - 1);
        if x - table[code] >= (table[up] - table[code]) * 0.5 {
            code = up;
        }
        u32::cast_from(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLES: [(Moment, u32); 4] = [
        (Moment::First, 8),
        (Moment::Second, 8),
        (Moment::First, 4),
        (Moment::Second, 4),
    ];

    /// Each table fills its codes with increasing values in its range, ends at 1, and holds 0
    /// except the 4-bit second moment's; its ends are those the construction gives by hand.
    #[test]
    fn the_tables_are_those_the_papers_describe() {
        for (moment, bits) in TABLES {
            let t = table(moment, bits);
            assert_eq!(t.len(), 1 << bits, "{moment:?} {bits}");
            assert!(
                t.windows(2).all(|w| w[0] < w[1]),
                "{moment:?} {bits} increases"
            );
            assert_eq!(t[t.len() - 1], 1.0);
            let zero = !(moment == Moment::Second && bits == 4);
            assert_eq!(t.contains(&0.0), zero, "{moment:?} {bits}");
        }
        // 8-bit signed: the lowest is −(1 − 0.9 / 128), the midpoint of the top of 64 steps over
        // [0.1, 1]; the smallest positive 10⁻⁶ · 0.55.
        let signed = table(Moment::First, 8);
        assert!(
            (signed[0] + (1.0 - 0.9 / 128.0)).abs() < 1e-7,
            "{}",
            signed[0]
        );
        let smallest = signed.iter().copied().find(|&v| v > 0.0).unwrap();
        assert!((smallest - 0.55e-6).abs() < 1e-12, "{smallest}");
        assert_eq!(table(Moment::Second, 8)[0], 0.0);
        // 4-bit signed: 7 magnitudes (1 + 2 + 4 over 10⁻², 10⁻¹, 1) each side, 0 and 1.
        let four = table(Moment::First, 4);
        assert!((four[0] + (1.0 - 0.9 / 8.0)).abs() < 1e-7, "{}", four[0]);
        assert_eq!(table(Moment::Second, 4)[0], 1.0 / 16.0);
    }

    /// No range of the coders' index holds more than two entries, so two steps up from its
    /// start always reach a value's code.
    #[test]
    fn each_range_of_the_index_holds_at_most_two_entries() {
        for (moment, bits) in TABLES {
            let start = &coder(moment, bits).start;
            for (range, next) in start.windows(2).enumerate() {
                let entries = i32::from(next[1]) - i32::from(next[0]);
                assert!(
                    entries <= 2,
                    "{moment:?} {bits}: range {range} holds {entries}"
                );
            }
        }
    }

    /// The search finds the nearest entry for values across each table's range, between its
    /// entries, on them and on their midpoints, and beyond its ends (within f32 rounding of the
    /// distances at a midpoint); an exact tie goes up.
    #[test]
    fn encode_finds_the_nearest_entry() {
        for (moment, bits) in TABLES {
            let t = table(moment, bits);
            let mut probes: Vec<f32> = (-1100..=1100).map(|k| k as f32 / 1000.0).collect();
            for w in t.windows(2) {
                probes.extend([w[0], w[1], (w[0] + w[1]) / 2.0, w[0] * 0.7 + w[1] * 0.3]);
            }
            for x in probes {
                let code = coder(moment, bits).encode(x) as usize;
                let distance = (t[code] - x).abs();
                let nearest = t
                    .iter()
                    .map(|v| (v - x).abs())
                    .fold(f32::INFINITY, f32::min);
                assert!(
                    distance - nearest <= 2.0 * f32::EPSILON * x.abs(),
                    "{moment:?} {bits}: {x} coded as {}",
                    t[code]
                );
            }
        }
        // Midway between 1/16 and 2/16 (exact in f32): the upper one.
        let four = coder(Moment::Second, 4);
        assert_eq!(four.encode(3.0 / 32.0), 1);
        assert_eq!(four.encode(3.0 / 32.0 - 1e-6), 0);
    }
}
