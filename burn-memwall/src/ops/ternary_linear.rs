//! BitNet b1.58's linear: `x · Q(w) + b` with ternary `Q(w)`, trained straight through the
//! quantisers; the op behind [`crate::nn::TernaryLinear`]. It needs no backend extension (Burn's
//! own ops on every backend), only a handwritten backward, so that `Q(w)` is recomputed rather
//! than saved.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::DType;

use super::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward_after};

/// `x · Q(w) + b` with `Q(w) = round(clip(w/γ, −1, 1))·γ`, the input quantised too when
/// `quantize_activations`; the gradient passes through each quantiser unchanged.
///
/// Under autodiff this is one node with a handwritten backward that keeps only the (quantised)
/// input, as Burn's linear keeps its input: `Q(w)` is recomputed from the latent weight in the
/// backward pass instead of being held from the forward.
pub fn ternary_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    quantize_activations: bool,
) -> Tensor<D> {
    let dims = x.dims();
    let [d_input, d_output] = weight.dims();
    let rows = dims[..D - 1].iter().product();
    let x = x.reshape([rows, d_input]);
    let input = |x: Tensor<2>| {
        if quantize_activations {
            quantized_input(x)
        } else {
            x
        }
    };
    let y = if x.is_autodiff() && (x.is_tracked() || weight.is_tracked()) {
        let saved = input(x.clone().inner());
        let latent = weight.clone().inner();
        let y = saved.clone().matmul(dequantized(latent.clone()));
        let key = ParamId::new();
        let backward = StraightThrough {
            input: saved,
            latent,
            key,
        };
        // A frozen weight gets no gradient.
        let params = if weight.is_tracked() {
            vec![(key, weight.clone().into_dispatch())]
        } else {
            Vec::new()
        };
        let context = BackwardContext::new(Box::new(backward), params);
        attach_backward_after(x, weight, Tensor::from_inner(y), context)
    } else {
        input(x).matmul(dequantized(weight))
    };
    let mut out = dims;
    out[D - 1] = d_output;
    let y = y.reshape(out);
    match bias {
        Some(bias) => y + bias.unsqueeze(),
        None => y,
    }
}

/// The backward of [`ternary_linear`]: `dx = dy · Q(w)ᵀ`, `dw = x̂ᵀ · dy` (`x̂` the quantised
/// input), straight through both quantisers.
#[derive(Debug)]
struct StraightThrough {
    /// `[rows, d_input]`, outside the graph.
    input: Tensor<2>,
    /// `[d_input, d_output]`, outside the graph.
    latent: Tensor<2>,
    /// The key under which the weight's gradient is handed over.
    key: ParamId,
}

impl HandwrittenBackward for StraightThrough {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let StraightThrough { input, latent, key } = *self;
        let dy = Tensor::<2>::from_dispatch(output_gradient);
        let dx = dy.clone().matmul(dequantized(latent).transpose());
        param_gradient(key, input.transpose().matmul(dy).into_dispatch());
        dx.into_dispatch()
    }
}

/// `Q(w) = round(clip(w/γ, −1, 1))·γ`.
fn dequantized(weight: Tensor<2>) -> Tensor<2> {
    let dtype = weight.dtype();
    let (ternary, scale) = ternarize(weight);
    ternary * scale.cast(dtype).unsqueeze()
}

/// The ternaries `round(clip(w/γ, −1, 1))` of `weight`, outside the graph, and γ (`[1]`).
pub(crate) fn ternarize(weight: Tensor<2>) -> (Tensor<2>, Tensor<1>) {
    let scale = absmean(&weight);
    (quantized(weight, scale.clone()), scale)
}

/// Each row to 255 levels of its absolute maximum (int8 absmax per token).
fn quantized_input(x: Tensor<2>) -> Tensor<2> {
    let step = x.clone().abs().max_dim(1).clamp_min(1e-5) / 127.0;
    (x / step.clone()).round().clamp(-128.0, 127.0) * step
}

/// γ: the mean absolute weight, `[1]`, floored so that an all-zero weight quantises to zero.
fn absmean(weight: &Tensor<2>) -> Tensor<1> {
    weight
        .clone()
        .detach()
        .cast(DType::F32)
        .abs()
        .mean()
        .clamp_min(1e-5)
}

/// `round(clip(w/γ, −1, 1))`, outside the graph.
fn quantized(weight: Tensor<2>, scale: Tensor<1>) -> Tensor<2> {
    let dtype = weight.dtype();
    (weight.detach() / scale.cast(dtype).unsqueeze())
        .round()
        .clamp(-1.0, 1.0)
}
