//! ReLU² (`relu(u)²`, Primer's MLP activation), whose backward pass keeps nothing but its own
//! output.
//!
//! Burn's autodiff of `relu(u).powi_scalar(2)` keeps `relu(u)` for the square's backward
//! besides the output, which the next linear keeps as its input. The derivative `2·relu(u)`
//! is `2·√y` of the output `y`, so the backward reads the output's buffer, which is held
//! anyway, and the activation costs no memory of its own. With the linear that reads it as one
//! node, the pair can keep `relu(u)` in 8 or 4 bits instead.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::activation::relu;
use burn::tensor::module::linear;

use super::folded_linear::{FoldedLinear, plus_bias};
use super::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward, attach_backward_after,
};
use super::saved_rows::{SavedPrecision, SavedRows};

/// `relu(u)²`: Burn's arithmetic, value for value.
///
/// Under autodiff the backward pass keeps only the output (the same buffer the caller holds)
/// and computes `du = 2·√y · dy`. `√(fl(r²))` is `r` to within one rounding, so the gradient
/// matches the composed op's to f32 precision (in bf16, to the output's 8 bits).
///
/// # Shapes
/// - `u`, output: any, one shape
pub fn relu_squared<const D: usize>(u: Tensor<D>) -> Tensor<D> {
    if !(u.is_autodiff() && u.is_tracked()) {
        return relu(u).powi_scalar(2);
    }
    let y = relu(u.clone().inner()).powi_scalar(2);
    let backward = SquareBackward { output: y.clone() };
    attach_backward(
        u,
        Tensor::from_inner(y),
        BackwardContext::new(Box::new(backward), Vec::new()),
    )
}

/// The backward of [`relu_squared`] from its output: `du = 2·√y · dy`.
#[derive(Debug)]
struct SquareBackward<const D: usize> {
    output: Tensor<D>,
}

impl<const D: usize> HandwrittenBackward for SquareBackward<D> {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        _: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let dy = Tensor::<D>::from_dispatch(output_gradient);
        (self.output.sqrt() * dy * 2.0).into_dispatch()
    }
}

/// `relu(u)² · weight + bias`: [`relu_squared`] and the linear that reads it (a ReLU² MLP's
/// down projection), as `burn::tensor::module::linear(relu(u).powi_scalar(2), weight, bias)`
/// computes them.
///
/// Under autodiff the backward pass keeps `relu(u)` at the precision `saved` says and a handle
/// on `weight`; it squares it again for the weight's gradient and reads the activation's
/// derivative `2·relu(u)` from it. In full this keeps what [`relu_squared`] and Burn's linear
/// keep together (one tensor of the MLP's hidden width, `relu(u)` instead of its square); in 8
/// or 4 bits per value ([`SavedPrecision`]) a quarter or an eighth of it. The forward pass is
/// exact either way; in low bits the input gradient `2·Q(r)·dh` is unbiased (`E[Q(r)] = r`)
/// and the weight's gradient `Q(r)²ᵀ·dy` is unbiased up to the square's curvature: each value
/// reads at most `s²/4` high in expectation, `s` its row's rounding step (in 4 bits enough to
/// cost a small LM 1.5% of validation loss, in 8 bits nothing measurable). (Keeping `Q(r²)`
/// instead would make the weight's gradient exact in expectation but bias the input gradient
/// through `√·` by far more: `r²`'s rows span a squared range.)
///
/// # Shapes
/// - `u`: `[..., d_ff]`
/// - `weight`: `[d_ff, d_output]` (`burn::nn::Linear`'s layout)
/// - `bias`: `[d_output]`
/// - output: `[..., d_output]`
///
/// # Panics
/// If `weight` does not take `d_ff` inputs.
pub fn relu_squared_linear<const D: usize>(
    u: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    saved: SavedPrecision,
) -> Tensor<D> {
    let down = FoldedLinear::new("relu_squared_linear", u.dims(), &weight);
    if !(u.is_autodiff() && (u.is_tracked() || weight.is_tracked())) {
        return linear(relu(u).powi_scalar(2), weight, bias);
    }
    let r = relu(down.rows(&u));
    let y = down.forward(r.clone().powi_scalar(2));
    let others = down.tracked_weight(&weight).into_iter().collect();
    let backward = SquareLinearBackward {
        relu: SavedRows::new(r, saved),
        down,
    };
    // The weight is a parent too, so that autodiff reaches it (an update hook on it) after
    // this node has handed over its gradient.
    let y = attach_backward_after(
        u,
        weight,
        y,
        BackwardContext::new(Box::new(backward), others),
    );
    plus_bias(y, bias)
}

/// The backward of [`relu_squared_linear`]: `dW = (r²)ᵀ·dy`, `dh = dy·Wᵀ`, `du = 2·r·dh`.
#[derive(Debug)]
struct SquareLinearBackward<const D: usize> {
    /// `relu(u)`, `[rows, d_ff]`, outside the graph.
    relu: SavedRows,
    down: FoldedLinear<D>,
}

impl<const D: usize> HandwrittenBackward for SquareLinearBackward<D> {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let SquareLinearBackward { relu, down } = *self;
        let r = relu.restore();
        let dh = down.backward(output_gradient, || r.clone().powi_scalar(2), param_gradient);
        (dh * r * 2.0).reshape(down.dims()).into_dispatch()
    }
}
