//! [`TernaryLinear`]: BitNet b1.58 quantisation-aware training. The forward pass uses the latent
//! weight quantised to `{−1, 0, +1} · γ` (γ its mean absolute value), and optionally the input
//! quantised to int8 per token (absmax); the backward pass is the straight-through estimator,
//! so any optimizer (and [`crate::optim::InBackward`]) trains the latent weight. For inference,
//! [`TernaryLinear::pack`] stores the ternaries in 2 bits each.

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::module::linear;

use crate::ops::ternary_code::PackedTernary;

/// Configuration of a [`TernaryLinear`].
#[derive(Config, Debug)]
pub struct TernaryLinearConfig {
    pub d_input: usize,
    pub d_output: usize,
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
    pub quantize_activations: bool,
}

impl TernaryLinear {
    /// `[..., d_input]` → `[..., d_output]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        ternary_linear(
            x,
            self.weight.val(),
            self.bias.as_ref().map(Param::val),
            self.quantize_activations,
        )
    }

    /// The ternaries `round(clip(w/γ, −1, 1))` in 2 bits each, and γ.
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
        PackedTernary::new(d_input, d_output, ternary.iter().map(|t| *t as i32), scale)
    }
}

/// `x · Q(w) + b` with `Q(w) = round(clip(w/γ, −1, 1))·γ`, the input quantised too when
/// `quantize_activations`; the gradient passes through each quantiser unchanged.
pub fn ternary_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    quantize_activations: bool,
) -> Tensor<D> {
    let scale = absmean(&weight);
    let dequantized =
        quantized(weight.clone(), scale.clone()) * scale.cast(weight.dtype()).unsqueeze();
    let weight = straight_through(weight, dequantized);
    let x = if quantize_activations {
        let step = x.clone().detach().abs().max_dim(D - 1).clamp_min(1e-5) / 127.0;
        let levels = (x.clone().detach() / step.clone())
            .round()
            .clamp(-128.0, 127.0);
        straight_through(x, levels * step)
    } else {
        x
    };
    linear(x, weight, bias)
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

/// `quantized`'s value with `latent`'s gradient.
fn straight_through<const D: usize>(latent: Tensor<D>, quantized: Tensor<D>) -> Tensor<D> {
    let dtype = latent.dtype();
    latent.clone() + (quantized.cast(dtype) - latent).detach()
}
