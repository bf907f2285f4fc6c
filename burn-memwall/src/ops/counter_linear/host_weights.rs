//! A counter linear's state read back on the host, published in [`crate::nn`].

use burn_memwall_codes::PackedLayout;
use burn_memwall_codes::counter::{CounterCode, words_per_row};

/// A counter linear's weights on the host: `[d_output, d_input]` codes packed per row, and one
/// scale and mean squared gradient per row.
#[derive(Clone, Debug, PartialEq)]
pub struct HostWeights {
    /// The code of every weight.
    pub code: CounterCode,
    /// Weights per row.
    pub d_input: usize,
    /// `[d_output, words_per_row(d_input)]`, row-major.
    pub words: Vec<u32>,
    /// `[d_output]`.
    pub scale: Vec<f32>,
    /// `[d_output]`.
    pub mean_square: Vec<f32>,
}

impl HostWeights {
    /// The weight `s·t`, `[d_output, d_input]` row-major.
    pub fn decode(&self) -> Vec<f32> {
        let (layout, width) = (
            PackedLayout::Counter(self.code),
            words_per_row(self.d_input),
        );
        let mut dense = vec![0f32; self.scale.len() * self.d_input];
        for ((out, words), scale) in dense
            .chunks_mut(self.d_input)
            .zip(self.words.chunks(width))
            .zip(&self.scale)
        {
            layout.decode_row(words, *scale, out);
        }
        dense
    }
}
