//! The Flex path: one rayon pass from the f32 values to the half-precision output.

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::FloatDType;
use burn::tensor::{Element, TensorData};
use burn_memwall_codes::hash::keyed_uniform;
use burn_memwall_codes::rounding::{HalfFormat, round_stochastically};
use half::{bf16, f16};
use rayon::prelude::*;

use super::{StochasticRoundingBackend, half_format};
use crate::ops::flex::{UPDATE_CHUNK, contiguous_f32};

impl StochasticRoundingBackend for Flex {
    fn round_stochastically(
        values: FloatTensor<Flex>,
        dtype: FloatDType,
        key: u32,
    ) -> FloatTensor<Flex> {
        let format = half_format(dtype.into()).expect("a half-precision dtype");
        let shape = values.shape();
        let values = contiguous_f32(values);
        let values = values.storage::<f32>();
        let data = match format {
            HalfFormat::Bf16 => {
                TensorData::new(rounded(values, key, format, bf16::from_f32), shape)
            }
            HalfFormat::F16 => TensorData::new(rounded(values, key, format, f16::from_f32), shape),
        };
        Flex::float_from_data(data, &Default::default())
    }
}

/// Each value rounded to `format` and converted by `convert`, exactly: the rounded value is
/// representable.
fn rounded<H: Element>(
    values: &[f32],
    key: u32,
    format: HalfFormat,
    convert: fn(f32) -> H,
) -> Vec<H> {
    let mut out = vec![convert(0.0); values.len()];
    out.par_chunks_mut(UPDATE_CHUNK)
        .zip(values.par_chunks(UPDATE_CHUNK))
        .enumerate()
        .for_each(|(chunk, (out, values))| {
            let first = chunk * UPDATE_CHUNK;
            for (i, (out, &x)) in out.iter_mut().zip(values).enumerate() {
                let u = keyed_uniform(key, (first + i) as u32);
                *out = convert(round_stochastically(x, format, u));
            }
        });
    out
}
