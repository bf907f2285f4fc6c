//! Products with a weight stored packed, decoded a block of rows at a time: a dense weight is
//! never materialised whole. Each block (at most [`BLOCK_WEIGHTS`] weights, 1 MiB in f32) is
//! decoded to `[rows, d_input]`, used by one matmul, and dropped.

use std::ops::Range;

use burn::prelude::*;

/// Weights per decoded block.
pub const BLOCK_WEIGHTS: usize = 1 << 18;

/// A `[d_output, d_input]` weight that decodes blocks of its rows to dense f32.
pub trait RowDecoder {
    fn d_input(&self) -> usize;
    fn d_output(&self) -> usize;
    /// `rows` of the weight, `[rows.len(), d_input]` in f32, on `device`.
    fn decode_rows(&self, rows: Range<usize>, device: &Device) -> Tensor<2>;

    /// The row blocks the products decode one at a time.
    fn blocks(&self) -> Vec<Range<usize>> {
        let (rows, per_block) = (self.d_output(), (BLOCK_WEIGHTS / self.d_input()).max(1));
        (0..rows.div_ceil(per_block))
            .map(|b| b * per_block..((b + 1) * per_block).min(rows))
            .collect()
    }

    /// `x · Wᵀ`: `[m, d_input]` → `[m, d_output]`, in f32.
    fn matmul(&self, x: Tensor<2>) -> Tensor<2> {
        let device = x.device();
        let blocks: Vec<Tensor<2>> = self
            .blocks()
            .into_iter()
            .map(|rows| {
                x.clone()
                    .matmul(self.decode_rows(rows, &device).transpose())
            })
            .collect();
        Tensor::cat(blocks, 1)
    }

    /// `dy · W`: `[m, d_output]` → `[m, d_input]`, in f32.
    fn matmul_transposed(&self, dy: Tensor<2>) -> Tensor<2> {
        let device = dy.device();
        self.blocks()
            .into_iter()
            .map(|rows| {
                let (start, len) = (rows.start, rows.len());
                dy.clone()
                    .narrow(1, start, len)
                    .matmul(self.decode_rows(rows, &device))
            })
            .reduce(|sum, part| sum + part)
            .expect("a weight has at least one row")
    }
}
