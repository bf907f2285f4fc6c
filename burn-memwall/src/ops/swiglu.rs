//! SwiGLU's product `silu(a) ∘ b`, whose backward pass keeps only `a` and `b` and recomputes
//! the sigmoid.
//!
//! Burn's autodiff of `silu(a) * b` keeps `σ(a)` and `silu(a)` beside the two inputs: two
//! tensors of the MLP's hidden width per token more than the backward needs. Like
//! [`super::rms_norm`], the passes are Burn's own ops (Cube devices fuse them), attached to the
//! graph with a handwritten backward.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::activation::{sigmoid, silu};

use super::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward_after};

/// `silu(gate) ∘ up`, `silu(a) = a · σ(a)`: Burn's arithmetic, value for value.
///
/// Under autodiff the backward pass keeps `gate` and `up` and nothing else (the output is
/// usually kept by the next linear).
///
/// # Shapes
/// - `gate`, `up`: `[..., d_ff]`, one shape
/// - output: `[..., d_ff]`
///
/// # Panics
/// If the shapes differ.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "swiglu: the gate's shape is not the up projection's"
    );
    if !(gate.is_autodiff() && (gate.is_tracked() || up.is_tracked())) {
        return silu(gate) * up;
    }
    let (a, b) = (gate.clone().inner(), up.clone().inner());
    let y = Tensor::from_inner(silu(a.clone()) * b.clone());
    let up_key = up.is_tracked().then(ParamId::new);
    let others = up_key
        .map(|key| (key, up.clone().into_dispatch()))
        .into_iter()
        .collect();
    let backward = SwigluBackward {
        gate: a,
        up: b,
        up_key,
    };
    // `up` is the node's second parent, so that autodiff reaches it after this node has handed
    // over its gradient.
    attach_backward_after(
        gate,
        up,
        y,
        BackwardContext::new(Box::new(backward), others),
    )
}

/// The backward of [`swiglu`]: `d_up = dy · silu(a)`, `d_gate = dy · b · σ(a)·(1 + a·(1 − σ(a)))`.
#[derive(Debug)]
struct SwigluBackward<const D: usize> {
    gate: Tensor<D>,
    up: Tensor<D>,
    /// The key under which the up projection's gradient is handed over, when it is tracked.
    up_key: Option<ParamId>,
}

impl<const D: usize> HandwrittenBackward for SwigluBackward<D> {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let SwigluBackward { gate, up, up_key } = *self;
        let dy = Tensor::<D>::from_dispatch(output_gradient);
        let s = sigmoid(gate.clone());
        if let Some(key) = up_key {
            let d_up = dy.clone() * (gate.clone() * s.clone());
            param_gradient(key, d_up.into_dispatch());
        }
        let slope = (s.clone().neg() + 1.0) * gate + 1.0;
        (dy * up * s * slope).into_dispatch()
    }
}
