//! [`TernaryLinear`]; the type's docs are the description.

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;

use super::PackedTernary;
use crate::ops::ternary_linear::{ternarize, ternary_linear};
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

/// A drop-in for `burn::nn::Linear` trained with ternary weights.
///
/// BitNet b1.58 quantisation-aware training. The forward pass uses the latent
/// weight quantised to `{−1, 0, +1} · γ` (γ its mean absolute value), and optionally the input
/// quantised to int8 per token (absmax); the backward pass is the straight-through estimator,
/// so any optimizer (and [`crate::optim::InBackward`]) trains the latent weight. For inference,
/// [`TernaryLinear::pack`] stores the ternaries in 2 bits each.
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
        let (ternary, scale) = ternarize(weight);
        let ternary = ternary
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
