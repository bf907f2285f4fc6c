//! Optimizers that change *when* and *where* a step happens, not its math.
//!
//! - [`InBackward`]: applies a `ModuleOptimizer`'s per-parameter step during `backward()`, as
//!   soon as each parameter's gradient is complete, and frees that gradient.
//! - [`FusedAdamW`]: Burn's AdamW with its per-parameter step fused into one in-place pass.

mod fused_adamw;
pub mod in_backward;

pub use fused_adamw::{FusedAdamW, FusedAdamWConfig};
pub use in_backward::{InBackward, InBackwardError, StepCounts};
