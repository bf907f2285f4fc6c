//! The feed-forward half of a block.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::{relu, silu};
use burn_memwall::nn::Routed;
use burn_memwall::ops::relu_squared::relu_squared;
use burn_memwall::ops::saved_rows::SavedPrecision;
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
    #[module(skip)]
    saved_precision: SavedPrecision,
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
            saved_precision: config.mlp_precision(),
        }
    }

    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>, route: Routed) -> Tensor<3> {
        let Some(gate) = &self.gate else {
            let up = self.up.forward(x, route);
            return match (self.savers, &self.down) {
                (SaverKind::Burn, down) => down.forward(relu(up).powi_scalar(2), route),
                // In full, the activation and the down projection keep one tensor between
                // them (the square) as separate ops; in low bits, one node keeps `relu(up)`.
                (SaverKind::Exact, BlockLinear::Dense(down))
                    if self.saved_precision != SavedPrecision::Full =>
                {
                    route.relu_squared_linear(down, up, self.saved_precision)
                }
                (SaverKind::Exact, down) => down.forward(relu_squared(up), route),
            };
        };
        let (gate, up) = (gate.forward(x.clone(), route), self.up.forward(x, route));
        match (self.savers, &self.down) {
            (SaverKind::Burn, down) => down.forward(silu(gate) * up, route),
            // A dense down projection recomputes the product it reads, rather than keep it.
            (SaverKind::Exact, BlockLinear::Dense(down)) => {
                route.swiglu_linear(down, gate, up, self.saved_precision)
            }
            (SaverKind::Exact, down) => down.forward(swiglu(gate, up), route),
        }
    }
}
