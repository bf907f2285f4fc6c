//! The products and the update of [`crate::nn::CounterLinear`], on any backend, from the packed
//! weight code ([`crate::ops::counter_code`]) and the per-row scale and mean squared gradient.
//!
//! A dense weight is never materialised whole: the code is decoded a block of rows at a time
//! (at most [`BLOCK_WEIGHTS`] weights, 1 MiB in f32) into `s·t`, which one matmul uses and then
//! drops. The update forms the weight gradient the same way, a block of rows at a time, and
//! consumes each block as soon as it is formed.
//!
//! This path decodes and updates on the host: on Flex that costs a copy of the code (0.75 byte
//! per weight) per call; on a GPU it also moves the code and each gradient block over the bus.
//! CubeCL kernels that decode inside the GEMM and update in one pass are not written yet.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::DType;
use rayon::prelude::*;

use super::counter_code::{CounterCode, CounterHyper, code_at, update_row, words_per_row};

/// Weights per decoded block.
pub const BLOCK_WEIGHTS: usize = 1 << 18;

/// A counter linear's weights, read back on the host: `[d_output, d_input]` codes packed per row,
/// and one scale and mean squared gradient per row.
#[derive(Clone, Debug, PartialEq)]
pub struct HostWeights {
    pub code: CounterCode,
    pub d_input: usize,
    /// `[d_output, words_per_row(d_input)]`, row-major.
    pub words: Vec<u32>,
    /// `[d_output]`.
    pub scale: Vec<f32>,
    /// `[d_output]`.
    pub mean_square: Vec<f32>,
}

impl HostWeights {
    pub fn d_output(&self) -> usize {
        self.scale.len()
    }

    fn row_words(&self, row: usize) -> &[u32] {
        let width = words_per_row(self.d_input);
        &self.words[row * width..(row + 1) * width]
    }

    /// `s·t` of `rows`, `[rows.len(), d_input]` row-major.
    pub fn dense_rows(&self, rows: Range<usize>) -> Vec<f32> {
        let mut dense = vec![0.0f32; rows.len() * self.d_input];
        dense
            .par_chunks_mut(self.d_input)
            .zip(rows)
            .for_each(|(out, row)| {
                let (words, scale) = (self.row_words(row), self.scale[row]);
                for (i, w) in out.iter_mut().enumerate() {
                    *w = scale * self.code.ternary(code_at(words, i)) as f32;
                }
            });
        dense
    }

    /// The row blocks of the decoded products.
    fn blocks(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let (rows, per_block) = (self.d_output(), (BLOCK_WEIGHTS / self.d_input).max(1));
        (0..rows.div_ceil(per_block)).map(move |b| b * per_block..((b + 1) * per_block).min(rows))
    }

    fn dense_block(&self, rows: Range<usize>, device: &Device) -> Tensor<2> {
        let len = rows.len();
        Tensor::from_data(
            TensorData::new(self.dense_rows(rows), [len, self.d_input]),
            (device, DType::F32),
        )
    }

    /// `x · (s·t)ᵀ`: `[m, d_input]` → `[m, d_output]`, in f32.
    pub fn matmul(&self, x: Tensor<2>) -> Tensor<2> {
        let device = x.device();
        let blocks: Vec<Tensor<2>> = self
            .blocks()
            .map(|rows| {
                x.clone()
                    .matmul(self.dense_block(rows, &device).transpose())
            })
            .collect();
        Tensor::cat(blocks, 1)
    }

    /// `dy · (s·t)`: `[m, d_output]` → `[m, d_input]`, in f32.
    pub fn matmul_transposed(&self, dy: Tensor<2>) -> Tensor<2> {
        let device = dy.device();
        let mut sum: Option<Tensor<2>> = None;
        for rows in self.blocks() {
            let (start, len) = (rows.start, rows.len());
            let part = dy
                .clone()
                .narrow(1, start, len)
                .matmul(self.dense_block(rows, &device));
            sum = Some(match sum {
                Some(sum) => sum + part,
                None => part,
            });
        }
        sum.expect("a layer has at least one output row")
    }

    /// One update of every row from the weight gradient `dyᵀ · x` (`dy` `[m, d_output]`, `x`
    /// `[m, d_input]`, both f32), formed and consumed a block of rows at a time.
    pub fn update(&mut self, hyper: &CounterHyper, step: u32, x: &Tensor<2>, dy: &Tensor<2>) {
        let width = words_per_row(self.d_input);
        for rows in self.blocks().collect::<Vec<_>>() {
            let (start, len) = (rows.start, rows.len());
            let gradient = dy
                .clone()
                .narrow(1, start, len)
                .transpose()
                .matmul(x.clone())
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("an f32 gradient");
            let code = self.code;
            let d_input = self.d_input;
            self.words[start * width..(start + len) * width]
                .par_chunks_mut(width)
                .zip(gradient.par_chunks(d_input))
                .zip(self.scale[rows.clone()].par_iter_mut())
                .zip(self.mean_square[rows.clone()].par_iter_mut())
                .zip(rows.into_par_iter())
                .for_each(|((((words, gradient), scale), mean_square), row)| {
                    update_row(code, hyper, step, row, words, gradient, mean_square, scale);
                });
        }
    }
}
