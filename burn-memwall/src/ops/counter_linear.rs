//! The weights of [`crate::nn::CounterLinear`] on the host, their products (through
//! [`PackedRows`]) and their update: the weight gradient is formed a block of rows at a time
//! and each block is consumed by the update as soon as it is formed.
//!
//! This path updates on the host: on Flex that costs a copy of the code (0.75 byte per weight)
//! per call; on a GPU it also moves the code and each gradient block over the bus. A CubeCL
//! kernel that updates in one pass is not written yet.

use std::ops::Range;

use burn::prelude::*;
use rayon::prelude::*;

use super::counter_code::{CounterCode, CounterHyper, code_at, update_row, words_per_row};
use super::packed_matmul::PackedRows;

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
    fn row_words(&self, row: usize) -> &[u32] {
        let width = words_per_row(self.d_input);
        &self.words[row * width..(row + 1) * width]
    }

    /// One update of every row from the weight gradient `dyᵀ · x` (`dy` `[m, d_output]`, `x`
    /// `[m, d_input]`, both f32), formed and consumed a block of rows at a time.
    pub fn update(&mut self, hyper: &CounterHyper, step: u32, x: &Tensor<2>, dy: &Tensor<2>) {
        let width = words_per_row(self.d_input);
        for rows in self.blocks() {
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

impl PackedRows for HostWeights {
    fn d_input(&self) -> usize {
        self.d_input
    }

    fn d_output(&self) -> usize {
        self.scale.len()
    }

    /// `s·t`.
    fn dense_rows(&self, rows: Range<usize>) -> Vec<f32> {
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
}
