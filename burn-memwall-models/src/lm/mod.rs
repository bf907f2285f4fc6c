//! The reference decoder-only language model every burn-memwall part is measured against.

mod attention;
mod config;
mod mlp;
mod model;

pub use attention::CausalSelfAttention;
pub use config::{AttentionKind, LmConfig, LossKind, MlpKind, PRESETS, human_count};
pub use mlp::Mlp;
pub use model::{Block, LanguageModel};
