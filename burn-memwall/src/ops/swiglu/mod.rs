//! SwiGLU's product `silu(a) ∘ b`, whose backward pass keeps only `a` and `b` and recomputes
//! the sigmoid; and the product with the linear that reads it, which recomputes the product too.
//!
//! Burn's autodiff of `silu(a) * b` keeps `σ(a)` and `silu(a)` beside the two inputs: two
//! tensors of the MLP's hidden width per token more than the backward needs, and the down
//! projection keeps the product as its input: a third.
//!
//! The product and the two input gradients are each one pass over the elements, with no
//! temporary: the kernels of `burn-memwall-kernels/src/swiglu.rs` on Cube devices (`cube.rs`),
//! a rayon pass on Flex (`flex.rs`).

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, DispatchTensor, backend_extension};
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::module::linear;

use super::folded_linear::{FoldedLinear, plus_bias};
use super::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward_after, attach_backward_after_both,
};
use super::saved_rows::{SavedPrecision, SavedRows};

/// `silu(gate) ∘ up`, `silu(a) = a · σ(a)`, in f32 (in half precision rounded once, at the
/// end).
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
    let autodiff = gate.is_autodiff();
    if !(autodiff && (gate.is_tracked() || up.is_tracked())) {
        let y = product(gate.inner(), up.inner());
        return if autodiff { Tensor::from_inner(y) } else { y };
    }
    let (a, b) = (gate.clone().inner(), up.clone().inner());
    let y = Tensor::from_inner(product(a.clone(), b.clone()));
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
        let d_up =
            up_key.map(|key| move |d_up: Tensor<D>| param_gradient(key, d_up.into_dispatch()));
        input_gradients(gate, up, dy, d_up).into_dispatch()
    }
}

/// `silu(a) ∘ b` outside any graph.
fn product<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::swiglu_forward(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// SwiGLU's input gradients from its output's `dy`: `d_up = dy · silu(a)`, handed to `d_up`
/// when the up projection is tracked, and `d_gate = dy · b · σ(a)·(1 + a·(1 − σ(a)))`, returned.
fn input_gradients<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    dy: Tensor<D>,
    d_up: Option<impl FnOnce(Tensor<D>)>,
) -> Tensor<D> {
    let (d_gate, up_gradient) =
        Dispatch::swiglu_backward(gate.into_dispatch(), up.into_dispatch(), dy.into_dispatch());
    if let Some(hand_over) = d_up {
        hand_over(Tensor::from_dispatch(up_gradient));
    }
    Tensor::from_dispatch(d_gate)
}

/// `(silu(gate) ∘ up) · weight + bias`: [`swiglu`] and the linear that reads it (an MLP's down
/// projection), as `burn::tensor::module::linear(silu(gate) * up, weight, bias)` computes them.
///
/// Under autodiff the backward pass keeps `gate`, `up` and a handle on `weight`, and
/// recomputes the product for the weight's gradient: Burn's linear would keep the product as
/// its input, one tensor of the MLP's hidden width per token. The product exists only while
/// the forward pass multiplies it and while the backward pass makes the weight's gradient.
///
/// `saved` says how `gate` and `up` are kept: in full, or in 8 or 4 bits per value rounded
/// stochastically ([`SavedPrecision`]). The forward pass is exact either way; in low bits the
/// backward reads `Q(gate)` and `Q(up)`, so the weight's gradient `silu(Q(a))ᵀ·Q(b)·dy` is
/// unbiased up to the curvature of `silu` (second order in the rounding step) and the input
/// gradients are those at the rounded values.
///
/// # Shapes
/// - `gate`, `up`: `[..., d_ff]`, one shape
/// - `weight`: `[d_ff, d_output]` (`burn::nn::Linear`'s layout)
/// - `bias`: `[d_output]`
/// - output: `[..., d_output]`
///
/// # Panics
/// If `gate` and `up` differ in shape, or `weight` does not take `d_ff` inputs.
pub fn swiglu_linear<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    saved: SavedPrecision,
) -> Tensor<D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "swiglu_linear: the gate's shape is not the up projection's"
    );
    let down = FoldedLinear::new("swiglu_linear", gate.dims(), &weight);
    let tracked = [gate.is_tracked(), up.is_tracked(), weight.is_tracked()];
    if !(gate.is_autodiff() && tracked.contains(&true)) {
        return linear(swiglu(gate, up), weight, bias);
    }
    let (gate_rows, up_rows) = (down.rows(&gate), down.rows(&up));
    let y = down.forward(product(gate_rows.clone(), up_rows.clone()));
    let up_key = up.is_tracked().then(ParamId::new);
    let others = [
        up_key.map(|key| (key, up.clone().into_dispatch())),
        down.tracked_weight(&weight),
    ]
    .into_iter()
    .flatten()
    .collect();
    let backward = SwigluLinearBackward {
        gate: SavedRows::new(gate_rows, saved),
        up: SavedRows::new(up_rows, saved),
        down,
        up_key,
    };
    // `up` and the weight are parents too, so that autodiff reaches them (the up projection's
    // backward, an update hook on the weight) after this node has handed over their gradients.
    let y = attach_backward_after_both(
        gate,
        up,
        weight,
        y,
        BackwardContext::new(Box::new(backward), others),
    );
    plus_bias(y, bias)
}

/// The backward of [`swiglu_linear`]: `dW = hᵀ·dy` with `h = silu(a) ∘ b` recomputed,
/// `dh = dy·Wᵀ`, then [`swiglu`]'s.
#[derive(Debug)]
struct SwigluLinearBackward<const D: usize> {
    /// `[rows, d_ff]`, outside the graph.
    gate: SavedRows,
    /// `[rows, d_ff]`, outside the graph.
    up: SavedRows,
    down: FoldedLinear<D>,
    up_key: Option<ParamId>,
}

impl<const D: usize> HandwrittenBackward for SwigluLinearBackward<D> {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let SwigluLinearBackward {
            gate,
            up,
            down,
            up_key,
        } = *self;
        let (gate, up) = (gate.restore(), up.restore());
        let hidden = || product(gate.clone(), up.clone());
        let dh = down.backward(output_gradient, hidden, param_gradient);
        let dims = down.dims();
        let d_up = up_key.map(|key| {
            move |d_up: Tensor<2>| param_gradient(key, d_up.reshape(dims).into_dispatch())
        });
        input_gradients(gate, up, dh, d_up)
            .reshape(dims)
            .into_dispatch()
    }
}

/// The backends' passes of [`swiglu`], element by element over one shape.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub(crate) trait SwigluBackend: Backend {
    /// `silu(gate) · up`.
    #[fusion(meta = cube::forward_spec)]
    fn swiglu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `(d_gate, d_up)` from `dy`, the gradient of `silu(gate) · up`.
    #[fusion(meta = cube::backward_spec)]
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}
