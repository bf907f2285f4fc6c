//! Products with a weight stored packed, decoded a block of rows at a time: a dense weight is
//! never materialised whole. Each block (at most [`BLOCK_WEIGHTS`] weights, 1 MiB in f32) is
//! decoded on the host into `[rows, d_input]`, used by one matmul, and dropped.
//!
//! On Flex the decode is a pass over the packed rows; on a GPU it also moves each block over
//! the bus. CubeCL kernels that decode inside the GEMM are not written yet.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::DType;

/// Weights per decoded block.
pub const BLOCK_WEIGHTS: usize = 1 << 18;

/// A `[d_output, d_input]` weight that decodes its rows to f32.
pub trait PackedRows {
    fn d_input(&self) -> usize;
    fn d_output(&self) -> usize;
    /// `rows` of the weight, `[rows.len(), d_input]` row-major.
    fn dense_rows(&self, rows: Range<usize>) -> Vec<f32>;

    /// The row blocks the products decode one at a time.
    fn blocks(&self) -> Vec<Range<usize>> {
        let rows = self.d_output();
        let per_block = (BLOCK_WEIGHTS / self.d_input()).max(1);
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
                    .matmul(dense_block(self, rows, &device).transpose())
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
                    .matmul(dense_block(self, rows, &device))
            })
            .reduce(|sum, part| sum + part)
            .expect("a weight has at least one row")
    }
}

fn dense_block<W: PackedRows + ?Sized>(
    weight: &W,
    rows: Range<usize>,
    device: &Device,
) -> Tensor<2> {
    let len = rows.len();
    Tensor::from_data(
        TensorData::new(weight.dense_rows(rows), [len, weight.d_input()]),
        (device, DType::F32),
    )
}
