//! burn-memwall: train bigger models in less memory with [Burn](https://burn.dev).
//!
//! Standard training keeps five pools alive at the peak of a step: attention scores, LM-head
//! logits, gradients, optimizer state and activations across depth. Each part of burn-memwall
//! removes one of them as a drop-in layer or optimizer decorator. This crate holds the parts
//! and the tools to measure them:
//!
//! - [`device`]: one runtime device choice for every program (`--device`, `BURN_DEVICE`);
//! - [`memory`]: peak-memory measurement of a training step, split into pools;
//! - [`ops`]: the memory-lean ops, each a custom Burn op with a handwritten backward (flash
//!   attention, fused linear + cross-entropy, a reversible chain), and the in-place optimizer
//!   updates;
//! - [`nn`]: drop-in layers built on them ([`nn::FlashMultiHeadAttention`],
//!   [`nn::FusedLinearCrossEntropyLoss`], [`nn::ReversibleSequence`]) and [`nn::Routed`],
//!   `burn::nn`'s layers trained by [`optim::InBackward`];
//! - [`optim`]: [`optim::InBackward`], any `ModuleOptimizer`'s step applied during backward, so
//!   that no gradient pool forms, and AdamW, SGD and Lion updated in place
//!   ([`optim::FusedAdamW`], [`optim::FusedSgd`], [`optim::FusedLion`]).

pub mod device;
pub mod memory;
pub mod nn;
pub mod ops;
pub mod optim;

pub use device::{DeviceChoice, DeviceError};
