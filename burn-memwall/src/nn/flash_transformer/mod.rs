//! Burn's `TransformerEncoder` and `TransformerDecoder` with their attention on
//! [`FlashMultiHeadAttention`](crate::nn::FlashMultiHeadAttention): the same configs, layers,
//! parameter paths and computation, without the `[batch, heads, s, s]` attention weights.

mod decoder;
mod encoder;

pub use decoder::{
    FlashTransformerDecoder, FlashTransformerDecoderInput, FlashTransformerDecoderLayer,
};
pub use encoder::{
    FlashTransformerEncoder, FlashTransformerEncoderInput, FlashTransformerEncoderLayer,
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
        true => x.clone() + dropout.forward(f(route.layer_norm(norm, x))),
        false => route.layer_norm(norm, x.clone() + dropout.forward(f(x))),
    }
}
