//! The feed-forward half of a block.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::{relu, silu};
use burn_memwall::nn::Routed;

use super::{LmConfig, MlpKind};

/// SwiGLU (`down(silu(gate x) ∘ up x)`) when `gate` is present, ReLU² (`down(relu(up x)²)`) otherwise.
#[derive(Module, Debug)]
pub struct Mlp {
    up: Linear,
    gate: Option<Linear>,
    down: Linear,
}

impl Mlp {
    pub fn new(config: &LmConfig, device: &Device) -> Self {
        let linear = |d_in, d_out| LinearConfig::new(d_in, d_out).with_bias(false).init(device);
        let (d, d_ff) = (config.d_model, config.d_ff);
        Self {
            up: linear(d, d_ff),
            gate: (config.mlp == MlpKind::SwiGlu).then(|| linear(d, d_ff)),
            down: linear(d_ff, d),
        }
    }

    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>, route: Routed) -> Tensor<3> {
        let hidden = match &self.gate {
            Some(gate) => silu(route.linear(gate, x.clone())) * route.linear(&self.up, x),
            None => relu(route.linear(&self.up, x)).powi_scalar(2),
        };
        route.linear(&self.down, hidden)
    }
}
