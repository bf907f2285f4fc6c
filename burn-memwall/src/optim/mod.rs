//! Optimizers that change *when* and *where* a step happens, not its math.
//!
//! - [`InBackward`]: applies a `ModuleOptimizer`'s per-parameter step during `backward()`, as
//!   soon as each parameter's gradient is complete, and frees that gradient;
//!   [`InBackwardTraining`] keeps that gain through burn-train's `Learner`.
//! - [`FusedAdamW`], [`FusedSgd`], [`FusedLion`]: Burn's AdamW, SGD and Lion
//!   with each per-parameter step fused into one in-place pass; [`LowBitAdamW`] with both
//!   moments kept in 8 or 4 bits per value.
//! - [`BlockCoordinate`]: one block of parameters trains at a time (BAdam), so that optimizer
//!   state exists for that block only.
//! - [`HostOffloaded`]: any of them with its state in host memory between updates, on devices
//!   with memory of their own; [`HostStepped`]: with its state and an f32 master of each weight
//!   in host memory, and the update run there.
//! - [`MasterWeights`], [`StochasticRounding`]: any of them for weights stored in bf16 or f16,
//!   with an f32 master copy or with stochastic rounding and no copy; [`LossScaled`] with a
//!   [`LossScale`] keeps f16 gradients in range.
//!
//! # State on Cube devices
//! The fused optimizers make their state at a parameter's first step, and update it in place
//! after. Where the model's step has grown the pools' arena pages past their first 2 MiB, the
//! state takes exact-size slots of the persistent pool, where Burn keeps the weights: on the
//! grown pages a long-lived state would leave holes between the step's transients. On a model
//! whose tensors all fit 2 MiB pages it stays on the pages, in the holes the transients leave
//! anyway. A state loaded from a record waits in host memory for its parameter's next update,
//! which places it as a state the optimizer made ([`FusedState`]).
//!
//! # Records on Cube devices
//! The fused optimizers write into a tensor's memory when no other tensor handle shares it.
//! A record taken on a Cube device (`Module::into_record`, `ModuleOptimizer::to_record`) reads
//! its tensors lazily, at its first access, and holds no handle: write a record out (or read its
//! data) before the next step, or keep the model it was taken from, else it reads that step's
//! result.

mod block_coordinate;
mod fused_adamw;
mod fused_lion;
mod fused_sgd;
mod half_precision;
mod host_offload;
mod in_backward;
mod loss_scaling;
mod low_bit_adamw;
mod placement;

pub use block_coordinate::{
    BlockCoordinate, BlockCoordinateConfig, BlockCoordinateError, BlockCoordinateRecord,
    BlockOrder, InactiveState,
};
pub use fused_adamw::{FusedAdamW, FusedAdamWConfig};
pub use fused_lion::{FusedLion, FusedLionConfig};
pub use fused_sgd::{FusedSgd, FusedSgdConfig, FusedSgdState};
pub use half_precision::{
    HalfPrecisionUpdate, MasterWeights, MasterWeightsState, StochasticRounding,
    StochasticRoundingState,
};
pub(crate) use host_offload::refuse_host;
pub use host_offload::{
    HostOffload, HostOffloadError, HostOffloaded, HostOffloadedState, HostStepped,
};
pub use in_backward::{
    CheckpointFiles, InBackward, InBackwardError, InBackwardTraining, StepCounts, StepMemory,
    train_step,
};
pub(crate) use in_backward::{ExternalUse, param_value};
pub use loss_scaling::{
    LossScale, LossScaleConfig, LossScaleError, LossScaleRecord, LossScaled, MAX_LOSS_SCALE,
};
pub use low_bit_adamw::{LowBitAdamW, LowBitAdamWConfig, LowBitAdamWState, MomentBits};
pub use placement::FusedState;
use placement::{StatePlacement, StateTensors, state_leaves_the_device};

use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{ModuleOptimizer, Optimizer};

/// `optimizer` over a whole module, clipping each gradient as `clipping` says.
fn with_clipping(
    optimizer: impl Optimizer,
    clipping: Option<&GradientClippingConfig>,
) -> ModuleOptimizer {
    let optimizer = ModuleOptimizer::from(optimizer);
    match clipping {
        Some(clipping) => optimizer.with_grad_clipping(clipping.init()),
        None => optimizer,
    }
}
