//! SwiGLU's product `silu(a) · b` and its two input gradients, one unit per element, each
//! pass one read of its inputs: with `s = σ(a)`, `d_b = dy · a · s` and
//! `d_a = dy · b · s · (1 + a · (1 − s))`. Arithmetic is f32 whatever `F` is.

use cubecl::prelude::*;

/// `σ(a)`; `exp(−a)` overflows to infinity for very negative `a`, which gives 0, as it should.
#[cube]
fn sigmoid(a: f32) -> f32 {
    1.0f32 / (1.0f32 + (-a).exp())
}

/// `out = silu(gate) · up`, element by element (all three contiguous, one shape).
#[cube(launch)]
pub fn swiglu_forward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let a = f32::cast_from(gate[i]);
    out[i] = F::cast_from(a * sigmoid(a) * f32::cast_from(up[i]));
}

/// `d_gate` and `d_up` from `dy`, the gradient of `silu(gate) · up` (all contiguous, one
/// shape).
#[cube(launch)]
pub fn swiglu_backward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    dy: &Tensor<F>,
    d_gate: &mut Tensor<F>,
    d_up: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= dy.len() {
        terminate!();
    }
    let a = f32::cast_from(gate[i]);
    let g = f32::cast_from(dy[i]);
    let s = sigmoid(a);
    d_up[i] = F::cast_from(g * a * s);
    d_gate[i] = F::cast_from(g * f32::cast_from(up[i]) * s * (1.0f32 + a * (1.0f32 - s)));
}
