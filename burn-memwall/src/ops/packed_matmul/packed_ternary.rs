//! Ternary weights packed 2 bits each for inference: the export of a trained
//! [`crate::nn::TernaryLinear`] (one scale γ for every row) or [`crate::nn::CounterLinear`] (a
//! scale per row), in [`burn_memwall_codes::ternary`]'s code: 0.25 byte per weight, plus 4
//! bytes per row. Serde-serialisable, to be saved in any serde format.

use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall_codes::PackedLayout;
use burn_memwall_codes::ternary::{set_ternary, ternary_at, words_per_row};

use super::packed_weight::PackedWeight;

/// A `[d_output, d_input]` ternary weight and its row scales, packed: `W = diag(scales) · T`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PackedTernary {
    d_input: usize,
    d_output: usize,
    words: Vec<u32>,
    scales: Vec<f32>,
}

impl PackedTernary {
    /// Packs `ternaries` (row-major `[d_output, d_input]`, each in `−1..=1`) with one scale per
    /// row. Panics on a value outside `−1..=1` or a wrong count.
    pub fn new(
        d_input: usize,
        d_output: usize,
        ternaries: impl IntoIterator<Item = i32>,
        scales: Vec<f32>,
    ) -> Self {
        assert_eq!(scales.len(), d_output, "one scale per row");
        let width = words_per_row(d_input);
        let mut words = vec![0u32; d_output * width];
        let mut count = 0;
        for (k, t) in ternaries.into_iter().enumerate() {
            assert!((-1..=1).contains(&t), "ternary {k} is {t}");
            let (row, i) = (k / d_input, k % d_input);
            assert!(
                row < d_output,
                "one ternary per weight: more than {d_output} rows"
            );
            set_ternary(&mut words[row * width..(row + 1) * width], i, t);
            count += 1;
        }
        assert_eq!(count, d_input * d_output, "one ternary per weight");
        Self {
            d_input,
            d_output,
            words,
            scales,
        }
    }

    /// `t` of weight `(row, i)`.
    pub fn ternary(&self, row: usize, i: usize) -> i32 {
        let width = words_per_row(self.d_input);
        ternary_at(&self.words[row * width..(row + 1) * width], i)
    }

    /// The scale of each row, `[d_output]`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// The packed rows, `[d_output, words_per_row(d_input)]` row-major (see
    /// [`burn_memwall_codes::ternary`]).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// The weight on `device`, for products that decode it inside the matmul.
    pub fn to_device(&self, device: &Device) -> PackedWeight {
        let width = words_per_row(self.d_input);
        PackedWeight {
            layout: PackedLayout::Ternary,
            d_input: self.d_input,
            codes: Tensor::from_data(
                TensorData::new(self.words.clone(), [self.d_output, width]),
                (device, DType::U32),
            ),
            scale: Tensor::from_data(
                TensorData::new(self.scales.clone(), [self.d_output]),
                (device, DType::F32),
            ),
        }
    }
}
