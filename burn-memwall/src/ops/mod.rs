//! Custom ops: one folder per op (its public function, its backend extension, the Flex path,
//! the wiring of its CubeCL kernels and its handwritten backward).
//!
//! The functional ops a model calls directly:
//! - [`flash_attention`]: exact attention that never holds the `[s_q, s_k]` scores;
//! - [`fused_linear_cross_entropy`]: an LM head's loss without its `[tokens, vocab]` logits;
//! - [`packed_matmul`]: products with a weight whose ternaries stay packed (the methods of
//!   [`crate::nn::PackedWeight`]);
//! - [`counter_linear`]: the counter synapse's in-place update of a block of rows;
//! - [`ternary_linear`]: BitNet b1.58's ternary linear, trained straight through;
//! - [`stochastic_rounding`]: f32 values to bf16 or f16 without bias;
//! - [`rms_norm`], [`swiglu`], [`relu_squared`]: a block's norm and MLP activations, keeping
//!   for backward only what it reads (the output and one f32 per row; both inputs, and with
//!   [`swiglu::swiglu_linear`] not even the product the down projection reads; nothing but the
//!   output, or with [`relu_squared::relu_squared_linear`] `relu(u)` in its place); with
//!   [`saved_rows::SavedPrecision`] the MLP's node keeps its activations in 8 or 4 bits. The
//!   norm's and SwiGLU's passes are kernels of their own (one pass each way); ReLU²'s are one
//!   or two element-wise Burn ops, which Cube devices fuse;
//! - [`rotary`]: rotary position embedding in one pass each way, on rows of several heads.
//!
//! Each item has one path. The types a layer takes or returns too ([`crate::nn::Reduction`],
//! [`crate::nn::GradientPass`], [`crate::nn::PackedWeight`], [`crate::nn::PackedTernary`],
//! [`crate::nn::HostWeights`]) are defined beside their op and published in [`crate::nn`].
//!
//! The others are the machinery of this crate's layers and optimizers: the in-place
//! optimizer updates (`adamw_update`, `low_bit_adamw_update`, `momentum_update`) and the node with a handwritten
//! backward that reversible chains, counter layers and the ternary linear attach (`handwritten_backward`).

pub(crate) mod adamw_update;
pub mod counter_linear;
#[cfg(feature = "cube")]
mod cube;
pub mod flash_attention;
mod flex;
mod folded_linear;
pub mod fused_linear_cross_entropy;
pub(crate) mod handwritten_backward;
pub(crate) mod low_bit_adamw_update;
pub(crate) mod momentum_update;
pub mod packed_matmul;
pub mod relu_squared;
pub mod rms_norm;
pub mod rotary;
pub mod saved_rows;
pub mod stochastic_rounding;
pub mod swiglu;
pub mod ternary_linear;
