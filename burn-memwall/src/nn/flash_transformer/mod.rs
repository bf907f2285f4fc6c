//! Burn's `TransformerEncoder` and `TransformerDecoder` with their attention on
//! [`FlashMultiHeadAttention`](crate::nn::FlashMultiHeadAttention): the same configs, layers,
//! parameter paths and computation, without the `[batch, heads, s, s]` attention weights.

mod decoder;
mod encoder;
mod reversible;

pub use decoder::{
    FlashTransformerDecoder, FlashTransformerDecoderAutoregressiveCache,
    FlashTransformerDecoderInput, FlashTransformerDecoderLayer,
};
pub use encoder::{
    FlashTransformerEncoder, FlashTransformerEncoderAutoregressiveCache,
    FlashTransformerEncoderInput, FlashTransformerEncoderLayer,
};

use burn::nn::{Dropout, LayerNorm};
use burn::prelude::*;

use super::Routed;

/// One residual sub-layer `f` of Burn's transformer layers, with its layer norm (its parameters
/// read through `route`): before `f` (`norm_first`, pre-norm) `x + dropout(f(norm(x)))`, else
/// after the sum (post-norm) `norm(x + dropout(f(x)))`.
fn residual(
    x: Tensor<3>,
    norm_first: bool,
    norm: &LayerNorm,
    dropout: &Dropout,
    route: Routed,
    f: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    match norm_first {
        true => x.clone() + pre_norm_branch(x, norm, dropout, route, f),
        false => route.layer_norm(norm, x.clone() + dropout.forward(f(x))),
    }
}

/// The branch of a pre-norm residual sub-layer, `dropout(f(norm(x)))`.
fn pre_norm_branch(
    x: Tensor<3>,
    norm: &LayerNorm,
    dropout: &Dropout,
    route: Routed,
    f: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    dropout.forward(f(route.layer_norm(norm, x)))
}

/// The part of a sequence an autoregressive cache has seen, as the output rows computed for it,
/// `[batch, seen, d_model]`: each call of Burn's `forward_autoregressive_inference` returns the
/// output for the whole sequence so far.
#[derive(Debug, Default)]
struct SeenOutput(Option<Tensor<3>>);

impl SeenOutput {
    /// The tokens of `sequence` `[batch, seq, d_model]` not seen yet.
    ///
    /// # Panics
    /// When `sequence` is not longer than the part seen.
    fn new_tokens(&self, sequence: Tensor<3>) -> Tensor<3> {
        let seq = sequence.dims()[1];
        let seen = self.0.as_ref().map_or(0, |output| output.dims()[1]);
        assert!(
            seq > seen,
            "autoregressive inference: the input holds {seq} tokens and the cache has seen {seen}; \
             each call gives the whole sequence so far, longer than the last (a new sequence \
             needs a new cache)"
        );
        sequence.narrow(1, seen, seq - seen)
    }

    /// The output for the whole sequence, `new` `[batch, new tokens, d_model]` appended.
    fn extend(&mut self, new: Tensor<3>) -> Tensor<3> {
        let output = match self.0.take() {
            Some(seen) => Tensor::cat(vec![seen, new], 1),
            None => new,
        };
        self.0 = Some(output.clone());
        output
    }
}
