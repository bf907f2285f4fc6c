//! Custom ops: one folder per op (its public function, its backend extension, the Flex path,
//! the wiring of its CubeCL kernels and its handwritten backward).
//!
//! The functional ops a model calls directly:
//! - [`flash_attention`]: exact attention that never holds the `[s_q, s_k]` scores;
//! - [`fused_linear_cross_entropy`]: an LM head's loss without its `[tokens, vocab]` logits;
//! - [`packed_matmul`]: products with a weight whose ternaries stay packed;
//! - [`counter_linear`]: the counter synapse's in-place update of a block of rows.
//!
//! The others are the machinery of this crate's layers and optimizers: the in-place
//! optimizer updates (`adamw_update`, `momentum_update`) and the node with a handwritten
//! backward that reversible chains and counter layers attach (`handwritten_backward`).

pub(crate) mod adamw_update;
pub mod counter_linear;
#[cfg(feature = "cube")]
mod cube;
pub mod flash_attention;
mod flex;
pub mod fused_linear_cross_entropy;
pub(crate) mod handwritten_backward;
pub(crate) mod momentum_update;
pub mod packed_matmul;
