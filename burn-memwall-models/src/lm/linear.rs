//! The linears of the blocks (attention projections and MLP), dense or quantised.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn_memwall::nn::{
    CounterLinear, CounterLinearConfig, Routed, TernaryLinear, TernaryLinearConfig,
};
use serde::{Deserialize, Serialize};

/// How the model's matrices hold and train their weights. `Dense`, `Ternary` and `Counter`
/// apply to the blocks' linears, and the embedding and head stay dense; `CounterAll` codes the
/// embedding and the head too. Norms always stay dense, trained by the chosen optimizer.
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
    /// `Counter` in the blocks, and the embedding and the head as counter codes too
    /// (`burn_memwall::nn::CounterEmbedding`, and a `CounterLinear` head read by the fused
    /// loss a block of the vocabulary at a time): no dense matrix is left. The coded table and
    /// head learn more slowly at first than dense ones trained by AdamW (docs/BENCHMARKS.md).
    CounterAll,
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
            LinearKind::Counter | LinearKind::CounterAll => {
                Self::Counter(counter_config(d_input, d_output).init_from_linear(linear))
            }
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

/// The counter settings of every coded matrix of the model: the defaults, without bias.
pub(crate) fn counter_config(d_input: usize, d_output: usize) -> CounterLinearConfig {
    CounterLinearConfig::new(d_input, d_output).with_bias(false)
}
