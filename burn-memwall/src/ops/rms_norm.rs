//! RMSNorm whose backward pass keeps only its output and one f32 root mean square per row: the
//! op behind [`crate::nn::Routed::saving_rms_norm`].
//!
//! Burn's autodiff of the composed norm (`x / rms(x) · γ`) keeps the input, `x / rms` and two
//! columns per row, and in half precision an f32 copy of the input too: `8·d + 8` bytes a row in
//! f32 beside the output, where this op keeps 4 (the f32 `rms`). The output is what the linears
//! reading it keep anyway, and the backward reads `x / rms` back from it as `y / γ` (Apex's
//! memory-efficient norm does the same), so the input is free to go once the residual sum has
//! read it. Like [`super::ternary_linear`], it needs no backend extension: the forward and
//! backward passes are Burn's own ops, which Cube devices fuse.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::DType;

use super::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward, attach_backward_after,
};

/// `x / rms(x) · γ` over the last dimension, `rms(x) = √(mean(x²) + ε)` taken in f32: the
/// arithmetic of `burn::nn::RmsNorm::forward`, value for value.
///
/// Under autodiff the backward pass keeps the output, `gamma` and `rms` (f32, one per row) and
/// nothing else. A frozen `gamma` gets no gradient.
///
/// # Shapes
/// - `x`: `[..., d]`
/// - `gamma`: `[d]`
/// - output: `[..., d]`
///
/// # Panics
/// If `gamma`'s length is not `x`'s last dimension. The backward reads `x / rms` back as
/// `y / γ`: a `gamma` element of exactly 0 gives its channel NaN gradients (and, through the
/// row's mean, its row), so train such a norm with Burn's `RmsNorm` instead.
pub fn rms_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, epsilon: f64) -> Tensor<D> {
    let d = x.dims()[D - 1];
    assert_eq!(
        gamma.dims(),
        [d],
        "rms_norm: the scale has {:?} elements for rows of {d}",
        gamma.dims()
    );
    if !(x.is_autodiff() && (x.is_tracked() || gamma.is_tracked())) {
        let rms = root_mean_square(&x, epsilon);
        return normalized(x, rms) * gamma.unsqueeze();
    }
    let (input, scale) = (x.clone().inner(), gamma.clone().inner());
    let rms = root_mean_square(&input, epsilon);
    let y = normalized(input, rms.clone()) * scale.clone().unsqueeze();
    let key = ParamId::new();
    let scale_trains = gamma.is_tracked();
    let backward = NormBackward {
        output: y.clone(),
        rms,
        scale,
        scale_key: scale_trains.then_some(key),
    };
    let y = Tensor::from_inner(y);
    if scale_trains {
        let context = BackwardContext::new(
            Box::new(backward),
            vec![(key, gamma.clone().into_dispatch())],
        );
        attach_backward_after(x, gamma, y, context)
    } else {
        attach_backward(x, y, BackwardContext::new(Box::new(backward), Vec::new()))
    }
}

/// `√(mean(x²) + ε)` over the last dimension, in f32: `[..., 1]`.
fn root_mean_square<const D: usize>(x: &Tensor<D>, epsilon: f64) -> Tensor<D> {
    (x.clone().cast(DType::F32).square().mean_dim(D - 1) + epsilon).sqrt()
}

/// `x / rms`, in `x`'s float type.
fn normalized<const D: usize>(x: Tensor<D>, rms: Tensor<D>) -> Tensor<D> {
    let dtype = x.dtype();
    x / rms.cast(dtype)
}

/// The backward of [`rms_norm`], in f32: with `x̂ = x / rms = y / γ` and `g = dy · γ`,
/// `dx = (g − x̂ · mean(g · x̂)) / rms` and `dγ = Σ_rows dy · x̂`.
#[derive(Debug)]
struct NormBackward<const D: usize> {
    /// `y`, `[..., d]`, outside the graph: the buffer the output's readers keep.
    output: Tensor<D>,
    /// `[..., 1]`, f32.
    rms: Tensor<D>,
    /// `[d]`.
    scale: Tensor<1>,
    /// The key under which the scale's gradient is handed over, when it trains.
    scale_key: Option<ParamId>,
}

impl<const D: usize> HandwrittenBackward for NormBackward<D> {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let NormBackward {
            output,
            rms,
            scale,
            scale_key,
        } = *self;
        let dtype = output.dtype();
        let dims = output.dims();
        let d = dims[D - 1];
        let dy = Tensor::<D>::from_dispatch(output_gradient).cast(DType::F32);
        let scale_f32 = scale.clone().cast(DType::F32).unsqueeze::<D>();
        let x_hat = output.cast(DType::F32) / scale_f32.clone();
        if let Some(key) = scale_key {
            let rows = dims[..D - 1].iter().product();
            let d_scale = (dy.clone() * x_hat.clone())
                .reshape([rows, d])
                .sum_dim(0)
                .reshape([d])
                .cast(scale.dtype());
            param_gradient(key, d_scale.into_dispatch());
        }
        let g = dy * scale_f32;
        let projection = (g.clone() * x_hat.clone()).mean_dim(D - 1);
        let dx = (g - x_hat * projection) / rms;
        dx.cast(dtype).into_dispatch()
    }
}
