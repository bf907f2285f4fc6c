//! The update of one parameter with one moment (SGD with momentum, Lion) or none (plain SGD)
//! in one pass: the parameter (and the moment) are read once and written back in place, the
//! gradient is read once. Arithmetic in f32 for every storage dtype.

use cubecl::prelude::*;

/// With `g' = g + l2·w`: `m' = keep·m + take·g'`,
/// `u = from_old·m + from_grad·g' + from_new·m'` (its sign when `sign`), `w' = decay·w − lr·u`.
/// All three tensors are contiguous with one shape.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn momentum_update_kernel<F: Float>(
    param: &mut Tensor<F>,
    grad: &Tensor<F>,
    moment: &mut Tensor<F>,
    l2: f32,
    keep: f32,
    take: f32,
    from_old: f32,
    from_grad: f32,
    from_new: f32,
    decay: f32,
    learning_rate: f32,
    #[comptime] sign: bool,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= param.len() {
        terminate!();
    }
    let w = f32::cast_from(param[i]);
    let g = f32::cast_from(grad[i]) + l2 * w;
    let m = f32::cast_from(moment[i]);
    let m_new = keep * m + take * g;
    moment[i] = F::cast_from(m_new);
    let mut u = from_old * m + from_grad * g + from_new * m_new;
    if sign {
        u = select(u > 0.0, 1.0f32, select(u < 0.0, -1.0f32, 0.0f32));
    }
    param[i] = F::cast_from(decay * w - learning_rate * u);
}

/// Plain SGD: `w' = w − lr·(g + l2·w)`. Both tensors are contiguous with one shape.
#[cube(launch)]
pub fn sgd_update_kernel<F: Float>(
    param: &mut Tensor<F>,
    grad: &Tensor<F>,
    l2: f32,
    learning_rate: f32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= param.len() {
        terminate!();
    }
    let w = f32::cast_from(param[i]);
    let g = f32::cast_from(grad[i]) + l2 * w;
    param[i] = F::cast_from(w - learning_rate * g);
}
