//! The AdamW update of one parameter in one pass: both moments and the parameter are read once
//! and written back in place, the gradient is read once. Arithmetic in f32 for every storage
//! dtype, in the order of `burn::optim::AdamW`, so that the two agree to rounding.

use cubecl::prelude::*;

/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
/// `w ← w·decay − lr · (m / c₁) / (√(v / c₂) + ε)` with `c₁ = 1 − β₁ᵗ`, `c₂ = 1 − β₂ᵗ` and
/// `decay = 1 − lr·weight_decay`. All four tensors are contiguous with one shape.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn adamw_update_kernel<F: Float>(
    param: &mut Tensor<F>,
    grad: &Tensor<F>,
    moment_1: &mut Tensor<F>,
    moment_2: &mut Tensor<F>,
    beta_1: f32,
    beta_2: f32,
    bias_correction_1: f32,
    bias_correction_2: f32,
    epsilon: f32,
    decay: f32,
    learning_rate: f32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= param.len() {
        terminate!();
    }
    let g = f32::cast_from(grad[i]);
    let m = f32::cast_from(moment_1[i]) * beta_1 + g * (1.0f32 - beta_1);
    let v = f32::cast_from(moment_2[i]) * beta_2 + g * g * (1.0f32 - beta_2);
    moment_1[i] = F::cast_from(m);
    moment_2[i] = F::cast_from(v);
    let delta = (m / bias_correction_1) / ((v / bias_correction_2).sqrt() + epsilon);
    param[i] = F::cast_from(f32::cast_from(param[i]) * decay - delta * learning_rate);
}
