//! The feed-forward half of a block.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::{relu, silu};
use burn_memwall::nn::Routed;
use burn_memwall::ops::relu_squared::relu_squared;
use burn_memwall::ops::swiglu::swiglu;

use super::{BlockLinear, LmConfig, MlpKind, SaverKind};

/// SwiGLU (`down(silu(gate x) ∘ up x)`) when `gate` is present, ReLU² (`down(relu(up x)²)`) otherwise.
#[derive(Module, Debug)]
pub struct Mlp {
    up: BlockLinear,
    gate: Option<BlockLinear>,
    down: BlockLinear,
    #[module(skip)]
    savers: SaverKind,
}

impl Mlp {
    pub fn new(config: &LmConfig, device: &Device) -> Self {
        let linear = |d_in, d_out| BlockLinear::new(config.linear, d_in, d_out, device);
        let (d, d_ff) = (config.d_model, config.d_ff);
        Self {
            up: linear(d, d_ff),
            gate: (config.mlp == MlpKind::SwiGlu).then(|| linear(d, d_ff)),
            down: linear(d_ff, d),
            savers: config.savers,
        }
    }

    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>, route: Routed) -> Tensor<3> {
        let hidden = match (&self.gate, self.savers) {
            (Some(gate), SaverKind::Burn) => {
                silu(gate.forward(x.clone(), route)) * self.up.forward(x, route)
            }
            (Some(gate), SaverKind::Exact) => {
                swiglu(gate.forward(x.clone(), route), self.up.forward(x, route))
            }
            (None, SaverKind::Burn) => relu(self.up.forward(x, route)).powi_scalar(2),
            (None, SaverKind::Exact) => relu_squared(self.up.forward(x, route)),
        };
        self.down.forward(hidden, route)
    }
}
