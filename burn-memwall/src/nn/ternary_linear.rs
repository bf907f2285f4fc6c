//! [`TernaryLinear`]: BitNet b1.58 quantisation-aware training. The forward pass uses the latent
//! weight quantised to `{−1, 0, +1} · γ` (γ its mean absolute value), and optionally the input
//! quantised to int8 per token (absmax); the backward pass is the straight-through estimator,
//! so any optimizer (and [`crate::optim::InBackward`]) trains the latent weight. For inference,
//! [`TernaryLinear::pack`] stores the ternaries in 2 bits each.

use burn::backend::DispatchTensor;
use burn::module::{Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::DType;

use crate::ops::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward_after,
};
use crate::ops::packed_matmul::PackedTernary;
use crate::optim::InBackward;
use crate::optim::param_value;

/// Configuration of a [`TernaryLinear`].
#[derive(Config, Debug)]
pub struct TernaryLinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// An ordinary bias parameter, as `burn::nn::Linear` has by default.
    #[config(default = true)]
    pub bias: bool,
    /// Quantise each token's input to int8 by its absolute maximum (BitNet's activations).
    #[config(default = false)]
    pub quantize_activations: bool,
}

impl TernaryLinearConfig {
    /// A layer initialised as `burn::nn::Linear` initialises its weights.
    pub fn init(&self, device: &Device) -> TernaryLinear {
        let linear = LinearConfig::new(self.d_input, self.d_output)
            .with_bias(self.bias)
            .init(device);
        self.init_from_linear(linear)
    }

    /// A layer training `linear`'s weights as its latent weights.
    pub fn init_from_linear(&self, linear: Linear) -> TernaryLinear {
        TernaryLinear {
            weight: linear.weight,
            bias: linear.bias,
            quantize_activations: self.quantize_activations,
        }
    }
}

/// A drop-in for `burn::nn::Linear` trained with ternary weights. See the [module
/// docs](self).
#[derive(Module, Debug)]
pub struct TernaryLinear {
    /// The latent weight, `[d_input, d_output]` as in `burn::nn::Linear`.
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// Whether the input is quantised to int8 per token as well.
    pub quantize_activations: bool,
}

impl TernaryLinear {
    /// `[..., d_input]` → `[..., d_output]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_routed(x, None)
    }

    /// `[..., d_input]` → `[..., d_output]`, the latent weight and the bias routed through
    /// `in_backward` (updated during its step's backward).
    pub fn forward_routed<const D: usize>(
        &self,
        x: Tensor<D>,
        in_backward: Option<&InBackward>,
    ) -> Tensor<D> {
        let weight = param_value(in_backward, &self.weight, &x);
        let bias = self
            .bias
            .as_ref()
            .map(|bias| param_value(in_backward, bias, &x));
        ternary_linear(x, weight, bias, self.quantize_activations)
    }

    /// The ternaries `round(clip(w/γ, −1, 1))` in 2 bits each, and γ (for every row).
    pub fn pack(&self) -> PackedTernary {
        let weight = self.weight.val();
        let [d_input, d_output] = weight.dims();
        let scale = absmean(&weight);
        let ternary = quantized(weight, scale.clone())
            .transpose()
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("f32 ternaries");
        let scale = scale.into_scalar::<f32>();
        PackedTernary::new(
            d_input,
            d_output,
            ternary.iter().map(|t| *t as i32),
            vec![scale; d_output],
        )
    }
}

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
    let scale = absmean(&weight);
    let dtype = weight.dtype();
    quantized(weight, scale.clone()) * scale.cast(dtype).unsqueeze()
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
