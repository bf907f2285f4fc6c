//! The feed-forward half of a block.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::{relu, silu};
use burn_memwall::nn::Routed;

use super::{BlockLinear, LmConfig, MlpKind};

/// SwiGLU (`down(silu(gate x) ∘ up x)`) when `gate` is present, ReLU² (`down(relu(up x)²)`) otherwise.
#[derive(Module, Debug)]
pub struct Mlp {
    up: BlockLinear,
    gate: Option<BlockLinear>,
    down: BlockLinear,
}

impl Mlp {
    pub fn new(config: &LmConfig, device: &Device) -> Self {
        let linear = |d_in, d_out| BlockLinear::new(config.linear, d_in, d_out, device);
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
            Some(gate) => silu(gate.forward(x.clone(), route)) * self.up.forward(x, route),
            None => relu(self.up.forward(x, route)).powi_scalar(2),
        };
        self.down.forward(hidden, route)
    }
}
