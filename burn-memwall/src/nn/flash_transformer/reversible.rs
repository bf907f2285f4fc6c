//! The encoder's layers as reversible couplings (RevNet, Reformer), for
//! [`FlashTransformerEncoder::with_reversible`](super::FlashTransformerEncoder::with_reversible):
//! two residual streams of the model's width, and each layer the additive coupling
//! `y₁ = x₁ + F(x₂)`, `y₂ = x₂ + G(y₁)` whose `F` is its pre-norm attention branch and `G` its
//! pre-norm feed-forward branch, on [`ReversibleSequence`].

use burn::module::Module;
use burn::nn::transformer::PositionWiseFeedForward;
use burn::nn::{Dropout, LayerNorm};
use burn::prelude::*;

use super::{FlashTransformerEncoderLayer, pre_norm_branch};
use crate::nn::flash_mha::{AttentionMasks, KeyValueCache};
use crate::nn::reversible::halves;
use crate::nn::{
    CouplingFunction, FlashMultiHeadAttention, ReversibleError, ReversibleSequence, Routed,
};

/// `F` of a layer's coupling: `dropout(mha(norm_2(x)))` under the input's masks.
#[derive(Module, Debug)]
struct AttentionCoupling {
    norm: LayerNorm,
    mha: FlashMultiHeadAttention,
    dropout: Dropout,
    #[module(skip)]
    masks: AttentionMasks,
}

/// `G` of a layer's coupling: `dropout(pwff(norm_1(x)))`.
#[derive(Module, Debug)]
struct FeedForwardCoupling {
    norm: LayerNorm,
    pwff: PositionWiseFeedForward,
    dropout: Dropout,
}

impl AttentionCoupling {
    /// `F(x)`; with a `cache`, `x` holds the new tokens only.
    fn forward_cached(&self, x: Tensor<3>, cache: Option<&mut KeyValueCache>) -> Tensor<3> {
        // The sequence routes the parameters itself, in its backward pass.
        let plain = Routed::new(None);
        pre_norm_branch(x, &self.norm, &self.dropout, plain, |x| {
            self.mha.self_attention(x, self.masks.clone(), plain, cache)
        })
    }
}

impl CouplingFunction<3> for AttentionCoupling {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_cached(x, None)
    }
}

impl CouplingFunction<3> for FeedForwardCoupling {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let plain = Routed::new(None);
        pre_norm_branch(x, &self.norm, &self.dropout, plain, |x| {
            plain.position_wise_feed_forward(&self.pwff, x)
        })
    }
}

/// Each layer's coupling, its modules shared (the same parameters, ids and memory).
fn couplings(
    layers: &[FlashTransformerEncoderLayer],
    masks: &AttentionMasks,
) -> Vec<(AttentionCoupling, FeedForwardCoupling)> {
    layers
        .iter()
        .map(|layer| {
            let f = AttentionCoupling {
                norm: layer.norm_2.clone(),
                mha: layer.mha.clone(),
                dropout: layer.dropout.clone(),
                masks: masks.clone(),
            };
            let g = FeedForwardCoupling {
                norm: layer.norm_1.clone(),
                pwff: layer.pwff.clone(),
                dropout: layer.dropout.clone(),
            };
            (f, g)
        })
        .collect()
}

/// The streams' mean, the encoder's output.
fn merge([first, second]: [Tensor<3>; 2]) -> Tensor<3> {
    (first + second) * 0.5
}

/// Why `layers` cannot be couplings: post-norm, or dropout (any of a layer's three dropout
/// modules, which are all its randomness).
pub(super) fn refusal(layers: &[FlashTransformerEncoderLayer]) -> Option<ReversibleError> {
    layers.iter().find_map(|layer| {
        let dropout = [&layer.dropout, &layer.mha.dropout, &layer.pwff.dropout]
            .into_iter()
            .map(|dropout| dropout.prob)
            .fold(0.0, f64::max);
        match (layer.norm_first, dropout) {
            (false, _) => Some(ReversibleError::PostNorm),
            (true, dropout) if dropout > 0.0 => Some(ReversibleError::Dropout(dropout)),
            _ => None,
        }
    })
}

/// `layers` over `x` `[batch, seq, d_model]` as one reversible sequence: both streams start as
/// `x`, and the output is their mean. Only the output's streams are kept for the backward pass,
/// which rebuilds each layer's input; with an [`InBackward`](crate::optim::InBackward) in
/// `route`, each layer's parameters update as the walk back leaves the layer.
///
/// # Panics
/// With [`refusal`]'s error.
pub(super) fn forward(
    layers: &[FlashTransformerEncoderLayer],
    x: Tensor<3>,
    masks: AttentionMasks,
    route: Routed,
) -> Tensor<3> {
    if let Some(error) = refusal(layers) {
        panic!("{error}");
    }
    // Without dropout these couplings are deterministic.
    let sequence = ReversibleSequence::new(couplings(layers, &masks))
        .with_in_backward(route.in_backward().cloned())
        .known_deterministic();
    merge(halves(sequence.forward(Tensor::cat(vec![x.clone(), x], 2))))
}

/// [`forward`] for the new tokens `x` of autoregressive inference, each layer's keys and values
/// in its `cache`.
pub(super) fn forward_cached(
    layers: &[FlashTransformerEncoderLayer],
    x: Tensor<3>,
    masks: AttentionMasks,
    caches: &mut [KeyValueCache],
) -> Tensor<3> {
    let streams = couplings(layers, &masks).into_iter().zip(caches).fold(
        [x.clone(), x],
        |[x1, x2], ((f, g), cache)| {
            let y1 = x1 + f.forward_cached(x2.clone(), Some(cache));
            let y2 = x2 + g.forward(y1.clone());
            [y1, y2]
        },
    );
    merge(streams)
}
