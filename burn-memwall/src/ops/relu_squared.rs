//! ReLU² (`relu(u)²`, Primer's MLP activation), whose backward pass keeps nothing but its own
//! output.
//!
//! Burn's autodiff of `relu(u).powi_scalar(2)` keeps `relu(u)` for the square's backward
//! besides the output, which the next linear keeps as its input. The derivative `2·relu(u)`
//! is `2·√y` of the output `y`, so the backward reads the output's buffer, which is held
//! anyway, and the activation costs no memory of its own.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::activation::relu;

use super::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward};

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
