//! The reference decoder-only language model every burn-memwall part is measured against.

mod attention;
mod budget;
mod config;
mod linear;
mod lora;
mod mlp;
mod model;
mod reversible;

pub use attention::CausalSelfAttention;
pub use budget::{
    CHAIN_BYTES_PER_BLOCK, GRAPH_BYTES_PER_OP, ROUTED_USE_BYTES, StepShape, TrainedWeights,
    parameter_census, saved_activations, step_budget,
};
pub use config::{
    AttentionKind, BlockKind, LmConfig, LossKind, MlpKind, PRESETS, SIZE_PRESETS, SaverKind,
    human_count,
};
use linear::counter_config;
pub use linear::{BlockLinear, LinearKind};
pub use lora::{LoraConfig, load_adapters, save_adapters};
pub use mlp::Mlp;
pub use model::{Block, GenerationCache, LanguageModel};
pub use reversible::{AttentionCoupling, MlpCoupling, reversible_blocks};
