//! Activations an op keeps for its backward pass, in full or in 8 or 4 bits per value with one
//! f32 scale per row, rounded stochastically so that what the backward reads back is the
//! activation in expectation (`E[Q(x)] = x`): a product with it that is linear in the saved
//! values, such as a weight's gradient, is then unbiased (ActNN, memory-native's int8/int4
//! saves). The code is `burn_memwall_codes::saved_rows`; Flex packs and restores it in one
//! rayon pass each way (`flex.rs`), Cube devices in one kernel each (`cube.rs`).

#[cfg(feature = "cube")]
mod cube;
mod flex;

use std::sync::atomic::{AtomicU32, Ordering};

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_memwall_codes::hash::draw_key;
use burn_memwall_codes::saved_rows::{limit, words_per_row};
use serde::{Deserialize, Serialize};

/// How an op keeps an activation for its backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SavedPrecision {
    /// As computed.
    #[default]
    Full,
    /// Codes `−127..=127` times the row's `max |x| / 127`: 1 byte per value and 4 per row.
    Int8,
    /// Codes `−7..=7` times the row's `max |x| / 7`: half a byte per value and 4 per row.
    Int4,
}

impl SavedPrecision {
    /// Bits per code; `None` in full.
    fn bits(self) -> Option<u32> {
        match self {
            Self::Full => None,
            Self::Int8 => Some(8),
            Self::Int4 => Some(4),
        }
    }

    /// The bytes of the two tensors an activation `[rows, width]` is kept in as codes: its
    /// `u32` words `[rows, words]` and its f32 scales `[rows, 1]`; `None` in full, where it
    /// keeps one tensor of its float type. Two allocations, not one: on Cube devices' pools
    /// each takes its own slot, and the scales a smaller pool's.
    pub fn code_and_scale_bytes(self, rows: usize, width: usize) -> Option<[usize; 2]> {
        self.bits()
            .map(|bits| [rows * 4 * words_per_row(width, bits), rows * 4])
    }
}

/// An activation `[rows, width]` as an op keeps it: in full, or in codes and row scales.
#[derive(Debug)]
// A node holds two, made once per step: boxing either variant would save nothing worth a
// pointer.
#[allow(clippy::large_enum_variant)]
pub(crate) enum SavedRows {
    Full(Tensor<2>),
    Quantized(Codes),
}

/// The codes of a quantised activation and what reads them back.
#[derive(Debug)]
pub(crate) struct Codes {
    /// `[rows, ⌈width / lanes⌉]`, `u32` (`burn_memwall_codes::saved_rows`).
    words: Tensor<2, Int>,
    /// `[rows, 1]`, f32.
    scales: Tensor<2>,
    bits: u32,
    width: usize,
    dtype: DType,
}

/// Draws taken so far in this process: each activation kept in low bits draws its rounding
/// under the next key, so that a run draws the same numbers on every backend.
static DRAWS: AtomicU32 = AtomicU32::new(0);

/// The seed of [`DRAWS`]' keys (any constant: the keys only need to differ from one another).
const DRAW_SEED: u32 = 0x005A_7ED0;

impl SavedRows {
    /// `x` (outside any graph) kept at `precision`.
    pub(crate) fn new(x: Tensor<2>, precision: SavedPrecision) -> Self {
        let Some(bits) = precision.bits() else {
            return Self::Full(x);
        };
        let [_, width] = x.dims();
        let dtype = x.dtype();
        // A row of zeros gets codes 0 under any positive scale.
        let scales = x
            .clone()
            .abs()
            .max_dim(1)
            .cast(DType::F32)
            .clamp_min(f32::MIN_POSITIVE)
            / limit(bits) as f32;
        let key = draw_key(DRAW_SEED, DRAWS.fetch_add(1, Ordering::Relaxed));
        let words = Tensor::from_dispatch(Dispatch::pack_rows(
            x.into_dispatch(),
            scales.clone().into_dispatch(),
            bits,
            key,
        ));
        Self::Quantized(Codes {
            words,
            scales,
            bits,
            width,
            dtype,
        })
    }

    /// The activation as the backward reads it: `x`, or its codes times their row's scale, in
    /// the float type it was given in.
    pub(crate) fn restore(self) -> Tensor<2> {
        match self {
            Self::Full(x) => x,
            Self::Quantized(codes) => Tensor::from_dispatch(Dispatch::restore_rows(
                codes.words.into_dispatch(),
                codes.scales.into_dispatch(),
                codes.bits,
                codes.width,
                codes.dtype.into(),
            )),
        }
    }
}

/// The backends' packing and restoring of [`SavedRows`]' codes.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub(crate) trait SavedRowsBackend: Backend {
    /// `values` `[rows, width]` (any float type) in steps of `scales` `[rows, 1]` (f32) at
    /// `bits` per code, value `i` (row-major) rounded with `keyed_uniform(key, i)`: `u32` words
    /// `[rows, ⌈width / lanes⌉]`.
    #[fusion(meta = cube::pack_spec)]
    fn pack_rows(
        values: FloatTensor<Self>,
        scales: FloatTensor<Self>,
        bits: u32,
        key: u32,
    ) -> IntTensor<Self>;

    /// The codes in `words` times their row's scale: `[rows, width]` in `dtype`.
    #[fusion(meta = cube::restore_spec)]
    fn restore_rows(
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
        bits: u32,
        width: usize,
        dtype: FloatDType,
    ) -> FloatTensor<Self>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory budget counts an activation in codes as the two tensors `SavedRows` makes,
    /// each of the bytes `code_and_scale_bytes` gives: on Cube devices' pools each takes its
    /// own slot, so one tensor of their sum would be placed where neither lies.
    #[test]
    fn codes_take_the_two_tensors_the_budget_counts() {
        let (rows, width) = (6, 45);
        let x = Tensor::<2>::from_data(
            TensorData::new(vec![0.5f32; rows * width], [rows, width]),
            &Device::flex(),
        );
        for precision in [SavedPrecision::Int8, SavedPrecision::Int4] {
            let SavedRows::Quantized(codes) = SavedRows::new(x.clone(), precision) else {
                panic!("{precision:?} keeps codes");
            };
            let bytes = |dims: [usize; 2], dtype: DType| dims[0] * dims[1] * dtype.size();
            assert_eq!(
                [
                    bytes(codes.words.dims(), codes.words.dtype()),
                    bytes(codes.scales.dims(), codes.scales.dtype()),
                ],
                precision.code_and_scale_bytes(rows, width).unwrap(),
                "{precision:?}"
            );
        }
        assert_eq!(SavedPrecision::Full.code_and_scale_bytes(rows, width), None);
    }

    /// A Cube device packs the words Flex packs, bit for bit, and restores the same values from
    /// them, so that a run draws the same roundings on every backend; padded rows included.
    #[cfg(feature = "wgpu")]
    #[test]
    fn cube_devices_pack_and_restore_as_flex_does() {
        let (rows, width) = (5, 45);
        let values: Vec<f32> = (0..rows * width)
            .map(|i| (i * 7919 % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let run = |device: &Device, bits: u32| {
            let x = Tensor::<2>::from_data(TensorData::new(values.clone(), [rows, width]), device);
            let scales = x.clone().abs().max_dim(1) / limit(bits) as f32;
            let words = Tensor::<2, Int>::from_dispatch(Dispatch::pack_rows(
                x.into_dispatch(),
                scales.clone().into_dispatch(),
                bits,
                12345,
            ));
            let restored = Tensor::<2>::from_dispatch(Dispatch::restore_rows(
                words.clone().into_dispatch(),
                scales.into_dispatch(),
                bits,
                width,
                FloatDType::F32,
            ));
            (
                words.into_data().try_to_vec::<u32>().unwrap(),
                restored.into_data().try_to_vec::<f32>().unwrap(),
            )
        };
        for bits in [8, 4] {
            let (flex_words, flex_values) = run(&Device::flex(), bits);
            let (cube_words, cube_values) = run(&Device::wgpu(Default::default()), bits);
            assert_eq!(flex_words, cube_words, "{bits} bits");
            assert_eq!(flex_values, cube_values, "{bits} bits");
            // Each restored value is within one step of its value.
            for (row, (restored, value)) in flex_values
                .chunks(width)
                .zip(values.chunks(width))
                .enumerate()
            {
                let step = value.iter().fold(0f32, |m, v| m.max(v.abs())) / limit(bits) as f32;
                for (r, v) in restored.iter().zip(value) {
                    assert!((r - v).abs() <= step * 1.0001, "row {row}: {r} for {v}");
                }
            }
        }
    }
}
