//! Stochastic rounding of f32 values to a half-precision output, one unit per element, through
//! `burn_memwall_codes::rounding` and the hash's uniform numbers: the Flex path's results, bit
//! for bit.

use burn_memwall_codes::hash::cube::keyed_uniform;
use burn_memwall_codes::rounding::cube::round_stochastically;
use cubecl::prelude::*;

/// `out[i] = round(values[i])` to `F` (bf16 or f16, whose `mantissa_bits` and
/// `exponent_floor` are given), with the uniform number `keyed_uniform(key, i)`. Both tensors
/// are contiguous with one shape.
#[cube(launch)]
pub fn stochastic_rounding_kernel<F: Float>(
    values: &Tensor<f32>,
    out: &mut Tensor<F>,
    key: u32,
    mantissa_bits: u32,
    exponent_floor: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let u = keyed_uniform(key, u32::cast_from(i));
    out[i] = F::cast_from(round_stochastically(
        values[i],
        mantissa_bits,
        exponent_floor,
        u,
    ));
}
