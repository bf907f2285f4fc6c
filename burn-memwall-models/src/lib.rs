//! Reference models, the text data pipeline and checkpoints of burn-memwall.
//!
//! The [`lm::LanguageModel`] here is the *baseline*: Burn's attention, full logits with
//! `CrossEntropyLoss`, AdamW. Every memory-saving part of `burn-memwall` is switched into this
//! same model and measured against it.

pub mod checkpoint;
pub mod data;
mod error;
pub mod generation;
pub mod llama;
pub mod lm;
pub mod pretrained;
pub mod training;

pub use error::Error;
