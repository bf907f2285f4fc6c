//! The reversible variant of the blocks: the residual stream is split into two halves, and each
//! block is an additive coupling whose `F` is the attention half-block and whose `G` is the MLP
//! half-block, both at half the width (`burn_memwall::nn::ReversibleSequence`).

use burn::module::Module;
use burn::nn::{RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig};
use burn::prelude::*;
use burn_memwall::nn::{CouplingFunction, ReversibleSequence, Routed};

use super::{BlockKind, CausalSelfAttention, LmConfig, Mlp};

/// `attention(norm(x))` on one half of the stream: `F` of a coupling.
#[derive(Module, Debug)]
pub struct AttentionCoupling {
    norm: RmsNorm,
    attention: CausalSelfAttention,
    rope: RotaryEncoding,
}

/// `mlp(norm(x))` on one half of the stream: `G` of a coupling.
#[derive(Module, Debug)]
pub struct MlpCoupling {
    norm: RmsNorm,
    mlp: Mlp,
}

impl CouplingFunction<3> for AttentionCoupling {
    /// `[batch, seq, d_model / 2]` → `[batch, seq, d_model / 2]`.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let route = Routed::new(None);
        let normed = route.rms_norm(&self.norm, x);
        self.attention.forward(normed, &self.rope, route)
    }
}

impl CouplingFunction<3> for MlpCoupling {
    /// `[batch, seq, d_model / 2]` → `[batch, seq, d_model / 2]`.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let route = Routed::new(None);
        self.mlp.forward(route.rms_norm(&self.norm, x), route)
    }
}

/// The `n_layers` couplings of a reversible model of `config` (whose `d_model` is the full
/// stream's width).
pub fn reversible_blocks(
    config: &LmConfig,
    device: &Device,
) -> ReversibleSequence<AttentionCoupling, MlpCoupling> {
    // Each half-block is a standard block of half the width.
    let half = LmConfig {
        d_model: config.block_width(),
        blocks: BlockKind::Standard,
        ..config.clone()
    };
    let norm = || {
        RmsNormConfig::new(half.d_model)
            .with_epsilon(half.norm_eps)
            .init(device)
    };
    // One table of constants, shared by every block.
    let rope = RotaryEncodingConfig::new(half.max_seq_len, half.d_head())
        .with_theta(half.rope_theta)
        .init(device);
    let blocks = (0..config.n_layers)
        .map(|_| {
            let f = AttentionCoupling {
                norm: norm(),
                attention: CausalSelfAttention::new(&half, device),
                rope: rope.clone(),
            };
            let g = MlpCoupling {
                norm: norm(),
                mlp: Mlp::new(&half, device),
            };
            (f, g)
        })
        .collect();
    ReversibleSequence::new(blocks)
}
