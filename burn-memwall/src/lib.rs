//! burn-memwall: train bigger models in less memory with [Burn](https://burn.dev).
//!
//! Standard training keeps five pools alive at the peak of a step: attention scores, LM-head
//! logits, gradients, optimizer state and activations across depth. Each part of burn-memwall
//! removes one of them as a drop-in layer or optimizer decorator. This crate holds the parts
//! and the tools to measure them:
//!
//! - [`device`]: one runtime device choice for every program (`--device`, `BURN_DEVICE`);
//! - [`memory`]: peak-memory measurement of a training step, split into pools;
//! - [`ops`]: the memory-lean ops (flash attention's tiled algorithm so far).

pub mod device;
pub mod memory;
pub mod ops;

pub use device::{DeviceChoice, DeviceError};
