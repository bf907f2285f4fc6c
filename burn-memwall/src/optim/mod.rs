//! Optimizers that change *when* and *where* a step happens, not its math.
//!
//! - [`InBackward`]: applies a `ModuleOptimizer`'s per-parameter step during `backward()`, as
//!   soon as each parameter's gradient is complete, and frees that gradient.

pub mod in_backward;

pub use in_backward::{InBackward, InBackwardError, StepCounts};
