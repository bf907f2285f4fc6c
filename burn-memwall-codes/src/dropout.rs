//! Attention dropout's keep-mask, drawn from the counter-based [`crate::hash`]: whether query
//! `i` of head `h` of batch element `b` keeps key `j` is a pure function of
//! `(seed, b, h, i, j)`, so the backward pass regenerates the forward's mask instead of saving
//! it (FlashAttention-2's method), and the Flex path and every kernel draw the same mask for
//! the same seed.
//!
//! The keys are chained through the hash: a stream per (seed, batch, head), one per query row
//! from it, one `u32` draw per key from that; a kernel computes the row's stream once and one
//! hash per (row, key) in its loop. A key is kept when its draw is at least
//! [`DropoutDraw::threshold`] `= ⌊p · 2³²⌉`, which drops it with probability `p` (to 2⁻³²).

use crate::hash::pcg_hash;

/// The scalars of one dropout draw, as a kernel is given them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutDraw {
    /// The 64-bit seed folded into 32 bits.
    pub seed: u32,
    /// A key is kept when its draw is at least this.
    pub threshold: u32,
}

impl DropoutDraw {
    /// The draw of dropout probability `prob` (in `[0, 1)`) with `seed`.
    pub fn new(prob: f64, seed: u64) -> Self {
        debug_assert!((0.0..1.0).contains(&prob), "dropout probability {prob}");
        Self {
            seed: pcg_hash((seed >> 32) as u32 ^ pcg_hash(seed as u32)),
            threshold: (prob * 2f64.powi(32)).round().min(u32::MAX as f64) as u32,
        }
    }

    /// The stream of query row `query` of head `head` of batch element `batch`.
    pub fn row_stream(&self, batch: u32, head: u32, query: u32) -> u32 {
        pcg_hash(query ^ pcg_hash(head ^ pcg_hash(batch ^ self.seed)))
    }

    /// Whether the row of `row_stream` keeps key `key`.
    pub fn keeps(&self, row_stream: u32, key: u32) -> bool {
        pcg_hash(key ^ row_stream) >= self.threshold
    }
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The draw on a device, step for step the host's.

    use cubecl::prelude::*;

    use crate::hash::cube::pcg_hash;

    /// The stream that the rows of head `head` of batch element `batch` draw from, with the
    /// [`super::DropoutDraw`]'s `seed`; [`row_stream`] takes it on.
    #[cube]
    pub fn pair_stream(seed: u32, batch: u32, head: u32) -> u32 {
        pcg_hash(head ^ pcg_hash(batch ^ seed))
    }

    /// [`super::DropoutDraw::row_stream`], from the pair's stream.
    #[cube]
    pub fn row_stream(pair_stream: u32, query: u32) -> u32 {
        pcg_hash(query ^ pair_stream)
    }

    /// [`super::DropoutDraw::keeps`].
    #[cube]
    pub fn keeps(row_stream: u32, key: u32, threshold: u32) -> bool {
        pcg_hash(key ^ row_stream) >= threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_the_asked_share_independently_of_neighbours() {
        let draw = DropoutDraw::new(0.25, 7);
        let n = 256u32;
        let mut kept = 0usize;
        let mut both_kept = 0usize;
        for query in 0..n {
            let (row, next_row) = (
                draw.row_stream(1, 2, query),
                draw.row_stream(1, 2, query + 1),
            );
            for key in 0..n {
                let keeps = draw.keeps(row, key);
                kept += keeps as usize;
                // Neighbours along the key and along the query: independent draws keep both
                // 9/16 of the time.
                both_kept += (keeps && draw.keeps(row, key + 1)) as usize;
                both_kept += (keeps && draw.keeps(next_row, key)) as usize;
            }
        }
        let cells = (n * n) as f64;
        // Binomial standard deviations 0.0017 and 0.0014: about 5 of each.
        assert!((kept as f64 / cells - 0.75).abs() < 0.009, "kept {kept}");
        assert!(
            (both_kept as f64 / (2.0 * cells) - 0.5625).abs() < 0.007,
            "both kept {both_kept}"
        );
    }

    #[test]
    fn every_coordinate_changes_the_draw() {
        let pattern = |draw: DropoutDraw, batch: u32, head: u32| -> Vec<bool> {
            let row = draw.row_stream(batch, head, 3);
            (0..64).map(|key| draw.keeps(row, key)).collect()
        };
        let draw = DropoutDraw::new(0.5, 1);
        let base = pattern(draw, 0, 0);
        assert_ne!(base, pattern(draw, 1, 0), "batch");
        assert_ne!(base, pattern(draw, 0, 1), "head");
        assert_ne!(
            base,
            pattern(DropoutDraw::new(0.5, 1 << 32), 0, 0),
            "high seed bits"
        );
        assert_eq!(
            base,
            pattern(DropoutDraw::new(0.5, 1), 0, 0),
            "a pure function"
        );
        assert_eq!(
            DropoutDraw::new(0.0, 9).threshold,
            0,
            "p = 0 keeps every key"
        );
    }
}
