//! The linears of the blocks (attention projections and MLP), dense or quantised.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn_memwall::nn::{
    CounterLinear, CounterLinearConfig, Routed, TernaryLinear, TernaryLinearConfig,
};
use serde::{Deserialize, Serialize};

/// How the blocks' linears hold and train their weights. Embeddings, norms and the head stay
/// as they are, trained by the chosen optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinearKind {
    /// `burn::nn::Linear`: f32 weights, trained by the optimizer (with its state).
    Dense,
    /// `burn_memwall::nn::TernaryLinear`: BitNet b1.58 ternary weights in the forward pass,
    /// trained through f32 latent weights by the optimizer.
    Ternary,
    /// `burn_memwall::nn::CounterLinear`: 6-bit counter synapses that update themselves in
    /// backward; no weight parameter and no optimizer state.
    Counter,
}

/// One linear of a block, without bias.
#[derive(Module, Debug)]
pub enum BlockLinear {
    Dense(Linear),
    Ternary(TernaryLinear),
    Counter(CounterLinear),
}

impl BlockLinear {
    pub fn new(kind: LinearKind, d_input: usize, d_output: usize, device: &Device) -> Self {
        let linear = LinearConfig::new(d_input, d_output)
            .with_bias(false)
            .init(device);
        match kind {
            LinearKind::Dense => Self::Dense(linear),
            LinearKind::Ternary => Self::Ternary(
                TernaryLinearConfig::new(d_input, d_output)
                    .with_bias(false)
                    .init_from_linear(linear),
            ),
            LinearKind::Counter => Self::Counter(
                CounterLinearConfig::new(d_input, d_output)
                    .with_bias(false)
                    .init_from_linear(&linear)
                    .expect("the default counter limit is valid"),
            ),
        }
    }

    /// `[..., d_input]` → `[..., d_output]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>, route: Routed) -> Tensor<D> {
        match self {
            Self::Dense(layer) => route.linear(layer, x),
            Self::Ternary(layer) => route.ternary_linear(layer, x),
            Self::Counter(layer) => route.counter_linear(layer, x),
        }
    }
}
