//! Activations an op keeps for its backward pass, in full or in 8 or 4 bits per value with one
//! f32 scale per row, rounded stochastically so that what the backward reads back is the
//! activation in expectation (`E[Q(x)] = x`): a product with it that is linear in the saved
//! values, such as a weight's gradient, is then unbiased (ActNN, memory-native's int8/int4
//! saves). Burn's own int ops pack the codes, four (8 bits) or eight (4 bits) to an `i32` word,
//! on every backend.

use burn::prelude::*;
use burn::tensor::{DType, Distribution, IntDType};
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
    /// Bits per code, and the largest code (codes are `−limit..=limit`, the scale is
    /// `max |x| / limit`).
    fn code(self) -> Option<(u32, i32)> {
        match self {
            Self::Full => None,
            Self::Int8 => Some((8, 127)),
            Self::Int4 => Some((4, 7)),
        }
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
    /// `[rows, ⌈width / lanes⌉]`, `i32`: lane `k` of a word holds its code in bits
    /// `bits·k..bits·(k + 1)`, offset by `2^(bits − 1)` below the top lane; the top lane holds
    /// the code as it is (signed), so that no sum overflows.
    words: Tensor<2, Int>,
    /// `[rows, 1]`, f32.
    scales: Tensor<2>,
    bits: u32,
    width: usize,
    dtype: DType,
}

impl SavedRows {
    /// `x` (outside any graph) kept at `precision`; the stochastic rounding draws from the
    /// device's random numbers.
    pub(crate) fn new(x: Tensor<2>, precision: SavedPrecision) -> Self {
        let Some((bits, limit)) = precision.code() else {
            return Self::Full(x);
        };
        let [rows, width] = x.dims();
        let (dtype, device) = (x.dtype(), x.device());
        let x = x.cast(DType::F32);
        // A row of zeros gets codes 0 under any positive scale.
        let scales = x.clone().abs().max_dim(1).clamp_min(f32::MIN_POSITIVE) / limit as f32;
        let uniform = Tensor::<2>::random([rows, width], Distribution::Uniform(0.0, 1.0), &device)
            .cast(DType::F32);
        // floor(v + u) with u uniform in [0, 1) is ⌈v⌉ with probability v − ⌊v⌋: unbiased. The
        // clamp only catches a quotient rounded past the limit.
        let codes = (x / scales.clone() + uniform)
            .floor()
            .clamp(-limit as f32, limit as f32)
            .int();
        let lanes = (32 / bits) as usize;
        let words = width.div_ceil(lanes);
        let codes = match words * lanes - width {
            0 => codes,
            pad => Tensor::cat(vec![codes, Tensor::zeros([rows, pad], &device)], 1),
        };
        let lane_offsets = lane_values(lanes, &device, |k| match k + 1 < lanes {
            true => 1 << (bits - 1),
            false => 0,
        });
        let lane_weights = lane_values(lanes, &device, |k| 1 << (bits as usize * k));
        let words = ((codes.reshape([rows, words, lanes]) + lane_offsets) * lane_weights)
            .sum_dim(2)
            .reshape([rows, words])
            .cast(IntDType::I32);
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
        let Codes {
            words,
            scales,
            bits,
            width,
            dtype,
        } = match self {
            Self::Full(x) => return x,
            Self::Quantized(codes) => codes,
        };
        let [rows, count] = words.dims();
        let lanes = (32 / bits) as usize;
        let mask = (1 << bits) - 1;
        let codes = (0..lanes)
            .map(|k| {
                let shifted = words
                    .clone()
                    .bitwise_right_shift_scalar((bits as usize * k) as i32);
                match k + 1 < lanes {
                    true => shifted.bitwise_and_scalar(mask) - (1 << (bits - 1)),
                    // The top lane's shift keeps the sign: its code as stored.
                    false => shifted,
                }
            })
            .collect();
        let codes = Tensor::stack::<3>(codes, 2)
            .reshape([rows, count * lanes])
            .narrow(1, 0, width);
        (codes.float().cast(DType::F32) * scales).cast(dtype)
    }
}

/// `[1, 1, lanes]`: `value(k)` for each lane `k`.
fn lane_values(lanes: usize, device: &Device, value: impl Fn(usize) -> i64) -> Tensor<3, Int> {
    let values: Vec<i64> = (0..lanes).map(value).collect();
    Tensor::<1, Int>::from_ints(values.as_slice(), device).reshape([1, 1, lanes])
}
