//! The reversible variant of the blocks (RevNet, Reformer): two residual streams of the model's
//! full width, and each block an additive coupling whose `F` is the standard attention
//! sub-block and whose `G` is the standard MLP sub-block (`burn_memwall::nn::ReversibleSequence`),
//! so a reversible model has the standard one's parameters.

use burn::module::Module;
use burn::nn::{RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn_memwall::nn::{CouplingFunction, KeyValueCache, ReversibleSequence, Routed};

use super::model::rms_norm;
use super::{CausalSelfAttention, LmConfig, Mlp, SaverKind};

/// `attention(norm(x))` on one stream: `F` of a coupling.
#[derive(Module, Debug)]
pub struct AttentionCoupling {
    norm: RmsNorm,
    attention: CausalSelfAttention,
    rope: RotaryEncoding,
    #[module(skip)]
    savers: SaverKind,
}

/// `mlp(norm(x))` on one stream: `G` of a coupling.
#[derive(Module, Debug)]
pub struct MlpCoupling {
    norm: RmsNorm,
    mlp: Mlp,
    #[module(skip)]
    savers: SaverKind,
}

impl AttentionCoupling {
    /// `F(x)`; with a `cache`, `x` holds the tokens after those it has seen.
    pub(super) fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: Option<&mut KeyValueCache>,
    ) -> Tensor<3> {
        let route = Routed::new(None);
        let normed = rms_norm(self.savers, route, &self.norm, x);
        self.attention
            .forward_cached(normed, &self.rope, route, cache)
    }
}

impl CouplingFunction<3> for AttentionCoupling {
    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_cached(x, None)
    }
}

impl CouplingFunction<3> for MlpCoupling {
    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let route = Routed::new(None);
        self.mlp
            .forward(rms_norm(self.savers, route, &self.norm, x), route)
    }
}

/// The `n_layers` couplings of a reversible model of `config`, each of a standard block's
/// sub-blocks. The sequence reads and returns both streams side by side,
/// `[batch, seq, 2 · d_model]`.
pub fn reversible_blocks(
    config: &LmConfig,
    device: &Device,
) -> ReversibleSequence<AttentionCoupling, MlpCoupling> {
    let norm = || {
        RmsNormConfig::new(config.d_model)
            .with_epsilon(config.norm_eps)
            .init(device)
    };
    // One table of constants, shared by every block.
    let rope = RotaryEncodingConfig::new(config.max_seq_len, config.d_head())
        .with_theta(config.rope_theta)
        .init(device);
    let blocks = (0..config.n_layers)
        .map(|_| {
            let f = AttentionCoupling {
                norm: norm(),
                attention: CausalSelfAttention::new(config, device),
                rope: rope.clone(),
                savers: config.savers,
            };
            let g = MlpCoupling {
                norm: norm(),
                mlp: Mlp::new(config, device),
                savers: config.savers,
            };
            (f, g)
        })
        .collect();
    let sequence = ReversibleSequence::new(blocks);
    // Each inversion in bf16 or f16 loses about a rounding of the streams, and the gradients
    // computed from the rebuilt inputs drift with them (a `small` LM learned 20% worse in bf16
    // than in f32 without anchors, as well as f32 with them). Keeping every block's input
    // rebuilds nothing: 2 streams × d_model per token per block, far below a standard block's
    // saved activations.
    match device.settings().float_dtype {
        FloatDType::F32 | FloatDType::F64 => sequence,
        _ => sequence.with_anchor_every(1),
    }
}
