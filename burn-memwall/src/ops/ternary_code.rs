//! Ternary weights packed 2 bits each for inference: the export of a trained
//! [`crate::nn::TernaryLinear`]. A weight `t ∈ {−1, 0, +1}` is stored as `t + 1` in bits
//! `2i .. 2i + 2` of word `i / 16` of its row (16 weights per `u32` word, rows padded to whole
//! words), with one scale γ for the whole matrix: 0.25 byte per weight.

use std::ops::Range;

use burn::prelude::*;

use burn::tensor::DType;

use super::packed_matmul::RowDecoder;

/// Weights per `u32` word.
pub const TERNARIES_PER_WORD: usize = 16;

/// Words that hold a row of `d_input` ternaries.
pub fn ternary_words_per_row(d_input: usize) -> usize {
    d_input.div_ceil(TERNARIES_PER_WORD)
}

/// A `[d_output, d_input]` ternary weight and its scale, packed.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedTernary {
    d_input: usize,
    d_output: usize,
    words: Vec<u32>,
    scale: f32,
}

impl PackedTernary {
    /// Packs `ternaries` (row-major `[d_output, d_input]`, each in `−1..=1`). Panics on a value
    /// outside it or a wrong count.
    pub fn new(
        d_input: usize,
        d_output: usize,
        ternaries: impl IntoIterator<Item = i32>,
        scale: f32,
    ) -> Self {
        let width = ternary_words_per_row(d_input);
        let mut words = vec![0u32; d_output * width];
        let mut count = 0;
        for (k, t) in ternaries.into_iter().enumerate() {
            assert!((-1..=1).contains(&t), "ternary {k} is {t}");
            let (row, i) = (k / d_input, k % d_input);
            words[row * width + i / TERNARIES_PER_WORD] |= ((t + 1) as u32) << (2 * (i % 16));
            count += 1;
        }
        assert_eq!(count, d_input * d_output, "one ternary per weight");
        Self {
            d_input,
            d_output,
            words,
            scale,
        }
    }

    /// `t` of weight `(row, i)`.
    pub fn ternary(&self, row: usize, i: usize) -> i32 {
        let word = self.words[row * ternary_words_per_row(self.d_input) + i / TERNARIES_PER_WORD];
        ((word >> (2 * (i % TERNARIES_PER_WORD))) & 0b11) as i32 - 1
    }

    /// γ.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The packed rows, `[d_output, ternary_words_per_row(d_input)]` row-major.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// `x · (γ·t)ᵀ`: `[..., d_input]` → `[..., d_output]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let dims = x.dims();
        let dtype = x.dtype();
        let rows = dims[..D - 1].iter().product();
        let y = self.matmul(
            x.reshape([rows, self.d_input])
                .cast(burn::tensor::DType::F32),
        );
        let mut out = dims;
        out[D - 1] = self.d_output;
        y.cast(dtype).reshape(out)
    }
}

impl RowDecoder for PackedTernary {
    fn d_input(&self) -> usize {
        self.d_input
    }

    fn d_output(&self) -> usize {
        self.d_output
    }

    /// Decoded on the host (a kernel that decodes inside the matmul is not written yet).
    fn decode_rows(&self, rows: Range<usize>, device: &Device) -> Tensor<2> {
        let len = rows.len();
        let dense: Vec<f32> = rows
            .flat_map(|row| {
                (0..self.d_input).map(move |i| self.scale * self.ternary(row, i) as f32)
            })
            .collect();
        Tensor::from_data(
            TensorData::new(dense, [len, self.d_input]),
            (device, DType::F32),
        )
    }
}
