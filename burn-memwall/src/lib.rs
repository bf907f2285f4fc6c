//! burn-memwall: train bigger models in less memory with [Burn](https://burn.dev).
//!
//! Standard training keeps five pools alive at the peak of a step: attention scores, LM-head
//! logits, gradients, optimizer state and activations across depth. Each part of burn-memwall
//! removes one of them as a drop-in layer or optimizer decorator.
//!
//! # The parts
//!
//! | pool | part | module |
//! |---|---|---|
//! | attention scores | flash attention, forward and backward | [`ops::flash_attention`], [`nn::FlashMultiHeadAttention`] |
//! | LM-head logits | fused, chunked linear + cross-entropy | [`ops::fused_linear_cross_entropy`], [`nn::FusedLinearCrossEntropyLoss`] |
//! | gradients | each parameter updated during backward, its gradient freed | [`optim::InBackward`], [`optim::InBackwardTraining`] (through the `Learner`), [`nn::Routed`] (Burn's layers routed through it) |
//! | optimizer state | AdamW, SGD and Lion updated in place | [`optim::FusedAdamW`], [`optim::FusedSgd`], [`optim::FusedLion`] |
//! | optimizer state and dense weights | 6-bit counter synapses, the optimizer inside the weight code | [`nn::CounterLinear`], [`nn::CounterEmbedding`], a coded head in [`nn::FusedLinearCrossEntropyLoss::try_forward_counter`] |
//! | weights at inference | ternary quantisation-aware training, exported 2 bits per weight | [`ops::ternary_linear`], [`nn::TernaryLinear`], [`nn::PackedTernary`] |
//! | activations across depth | reversible coupling blocks | [`nn::ReversibleSequence`] |
//!
//! Beside them: [`device`] (one runtime device choice for every program: `--device`,
//! `BURN_DEVICE`), [`memory`] (the peak memory of a step, split into pools) and [`codes`] (the
//! bit formats of the quantised weights, shared with the kernels).
//!
//! # Errors
//!
//! One policy, Burn's:
//! - A configuration is checked once, where it becomes a layer (`Config::init`,
//!   `init_from_linear`, `from_embedding`), which panics with a message naming the field and
//!   its value. Each such function says so under `# Panics`.
//! - A conversion from a Burn layer whose options the drop-in cannot honour is a `TryFrom`
//!   whose error names the option; nothing is silently changed. (The flash layers honour every
//!   option of Burn's, so theirs are `From`.)
//! - The inputs of a forward pass or an op are checked on every call, and a bad shape panics
//!   with a message naming the shapes (`# Shapes` and `# Panics` sections).
//! - Where a caller may rather recover than stop (targets outside the vocabulary, attention
//!   shapes that come from a user's config), a `try_` twin returns a typed error: an enum
//!   whose variants carry the values (e.g. [`ops::fused_linear_cross_entropy::FusedCrossEntropyError`],
//!   [`ops::flash_attention::FlashAttentionError`]). The panicking function is that twin with
//!   its error's message.
//! - Steps and files that can fail at run time (an in-backward step, a checkpoint) return
//!   `Result` with their own error enum ([`optim::InBackwardError`], [`DeviceError`]).

#![warn(missing_docs)]

pub mod device;
mod host;
pub mod memory;
pub mod nn;
pub mod ops;
pub mod optim;

/// The bit formats of the quantised weights (the counter code and the ternary code), from
/// their own crate, which the kernels read them from too.
pub use burn_memwall_codes as codes;
pub use device::{DeviceChoice, DeviceError};
