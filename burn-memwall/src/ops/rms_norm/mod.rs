//! RMSNorm whose backward pass keeps only its output and one f32 root mean square per row: the
//! op behind [`crate::nn::Routed::saving_rms_norm`].
//!
//! Burn's autodiff of the composed norm (`x / rms(x) · γ`) keeps the input, `x / rms` and two
//! columns per row, and in half precision an f32 copy of the input too: `8·d + 8` bytes a row in
//! f32 beside the output, where this op keeps 4 (the f32 `rms`). The output is what the linears
//! reading it keep anyway, and the backward reads `x / rms` back from it as `y / γ` (Apex's
//! memory-efficient norm does the same), so the input is free to go once the residual sum has
//! read it.
//!
//! Each pass is one read of its rows (Liger-Kernel's fused RMSNorm): the forward writes `y` and
//! `rms`, the backward `dx` and the scale's gradient, with no `[rows, d]` temporary. The
//! kernels are `burn-memwall-kernels/src/rms_norm.rs` (`cube.rs`); Flex runs the same
//! arithmetic in one rayon pass over the rows each way (`flex.rs`).

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, DispatchTensor, backend_extension};
use burn::module::ParamId;
use burn::prelude::*;

use super::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward, attach_backward_after,
};

/// `x / rms(x) · γ` over the last dimension, `rms(x) = √(mean(x²) + ε)` taken in f32: the
/// arithmetic of `burn::nn::RmsNorm::forward` (in half precision rounded once, at the end, where
/// Burn rounds each step).
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
/// `y / γ`: a `gamma` element of exactly 0 gives its channel NaN gradients, so train such a
/// norm with Burn's `RmsNorm` instead.
pub fn rms_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, epsilon: f64) -> Tensor<D> {
    let d = x.dims()[D - 1];
    assert_eq!(
        gamma.dims(),
        [d],
        "rms_norm: the scale has {:?} elements for rows of {d}",
        gamma.dims()
    );
    let autodiff = x.is_autodiff();
    if !(autodiff && (x.is_tracked() || gamma.is_tracked())) {
        let (y, _) = forward(x.inner(), gamma.inner(), epsilon);
        return if autodiff { Tensor::from_inner(y) } else { y };
    }
    let scale = gamma.clone().inner();
    let (y, rms) = forward(x.clone().inner(), scale.clone(), epsilon);
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

/// `(y, rms)` of `x` outside any graph: `rms` is `[rows, 1]`, f32.
fn forward<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, epsilon: f64) -> (Tensor<D>, Tensor<2>) {
    let dims = x.dims();
    let d = dims[D - 1];
    let rows = x.shape().num_elements() / d.max(1);
    let (y, rms) = Dispatch::rms_norm_forward(
        x.reshape([rows, d]).into_dispatch(),
        gamma.into_dispatch(),
        epsilon,
    );
    (
        Tensor::<2>::from_dispatch(y).reshape(dims),
        Tensor::from_dispatch(rms),
    )
}

/// The backward of [`rms_norm`].
#[derive(Debug)]
struct NormBackward<const D: usize> {
    /// `y`, `[..., d]`, outside the graph: the buffer the output's readers keep.
    output: Tensor<D>,
    /// `[rows, 1]`, f32.
    rms: Tensor<2>,
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
        let dims = output.dims();
        let [rows, _] = rms.dims();
        let d = dims[D - 1];
        let dy = Tensor::<D>::from_dispatch(output_gradient).reshape([rows, d]);
        let (dx, d_scale) = Dispatch::rms_norm_backward(
            dy.into_dispatch(),
            output.reshape([rows, d]).into_dispatch(),
            scale.into_dispatch(),
            rms.into_dispatch(),
            scale_key.is_some(),
        );
        if let Some(key) = scale_key {
            param_gradient(key, d_scale);
        }
        Tensor::<2>::from_dispatch(dx).reshape(dims).into_dispatch()
    }
}

/// The backends' passes of [`rms_norm`], on `[rows, d]` rows.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub(crate) trait RmsNormBackend: Backend {
    /// `(y, rms)`: `y = x / rms · γ` in `x`'s float type, `rms = √(mean(x²) + ε)` `[rows, 1]`
    /// in f32.
    #[fusion(meta = cube::forward_spec)]
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dx, dγ)` from the output `y`, its gradient `dy` (`y`'s float type), `γ` and `rms`:
    /// `dx = (dy · γ − (y / γ) · mean(dy · y)) / rms` row by row, and
    /// `dγ = Σ_rows dy · y / γ` (`[d]`, `γ`'s float type; zeros when `scale_gradient` is
    /// false).
    #[fusion(meta = cube::backward_spec)]
    fn rms_norm_backward(
        dy: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rms: FloatTensor<Self>,
        scale_gradient: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}
