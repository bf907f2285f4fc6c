//! Drop-in layers built on the memory-lean ops, each convertible from (or working with) the Burn
//! layer it replaces.
//!
//! - [`CounterLinear`]: a linear of 6-bit counter synapses that updates itself in its own
//!   backward (no weight parameter, no optimizer state), on [`crate::ops::counter_linear`];
//!   [`CounterEmbedding`], a token table of the same codes; [`HostWeights`], their state read
//!   back on the host;
//! - [`TernaryLinear`]: BitNet b1.58 quantisation-aware training of a linear, exported packed in
//!   2 bits per weight ([`PackedTernary`], multiplied on a device as a [`PackedWeight`]);
//! - [`FlashMultiHeadAttention`]: Burn's multi-head attention on [`crate::ops::flash_attention`];
//!   [`FlashTransformerEncoder`] and [`FlashTransformerDecoder`], Burn's transformer layers on it;
//!   [`KeyValueCache`], one attention layer's keys and values kept for generation;
//! - [`FusedLinearCrossEntropyLoss`]: an LM head's `Linear` + `CrossEntropyLoss` on
//!   [`crate::ops::fused_linear_cross_entropy`];
//! - [`Routed`]: `burn::nn`'s linear, embedding and RMSNorm with their parameters updated during
//!   backward by [`crate::optim::InBackward`];
//! - [`ReversibleSequence`]: additive coupling blocks whose activation memory does not grow with
//!   depth, one node of the graph with a handwritten backward.

mod counter_cross_entropy;
mod counter_embedding;
mod counter_linear;
mod flash_mha;
mod flash_transformer;
mod fused_linear_cross_entropy_loss;
mod reversible;
mod routed;
mod ternary_linear;

// Defined beside the ops that use them, published here only: a layer's user finds every type
// the layer takes or returns in `nn`.
pub use crate::ops::counter_linear::host_weights::HostWeights;
pub use crate::ops::fused_linear_cross_entropy::choices::{GradientPass, Reduction};
pub use crate::ops::packed_matmul::packed_ternary::PackedTernary;
pub use crate::ops::packed_matmul::packed_weight::PackedWeight;
pub use counter_cross_entropy::counter_loss_block_rows;
pub use counter_embedding::CounterEmbedding;
pub use counter_linear::{CounterLinear, CounterLinearConfig, CounterWeights};
pub use flash_mha::{FlashMhaInput, FlashMultiHeadAttention, KeyValueCache};
pub use flash_transformer::{
    FlashTransformerDecoder, FlashTransformerDecoderAutoregressiveCache,
    FlashTransformerDecoderInput, FlashTransformerDecoderLayer, FlashTransformerEncoder,
    FlashTransformerEncoderAutoregressiveCache, FlashTransformerEncoderInput,
    FlashTransformerEncoderLayer,
};
pub use fused_linear_cross_entropy_loss::{
    FusedLinearCrossEntropyLoss, FusedLinearCrossEntropyLossConfig,
};
pub use reversible::{CouplingFunction, ReversibleError, ReversibleSequence};
pub use routed::Routed;
pub use ternary_linear::{TernaryLinear, TernaryLinearConfig};
