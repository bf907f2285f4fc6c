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
//! anyway. A state loaded from a record lands on the pages, as Burn's optimizers' state does.
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

use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{ModuleOptimizer, Optimizer};
use burn::prelude::*;

use crate::memory::budget::arena_has_grown;

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

/// Where a fused optimizer makes its state, for a state that lives as long as training. On a
/// Cube device whose arena pages have grown ([`arena_has_grown`]: the step makes a tensor
/// larger than their first 2 MiB) the state takes exact-size slots of the persistent pool, as
/// the parameters do: there a state about a page's size would take a page of its own, and the
/// rest leave holes between the step's transients that later tensors do not fit (measured on
/// lavapipe, `small`: `memwall` 163.49 MiB with its moments on pages, 156.52 in slots). On
/// 2 MiB pages the state's tensors are smaller than a page and fill holes that the step's
/// transients leave anyway, so they stay there (`tiny` `memwall`: 21.62 MiB on pages, 24.00 in
/// slots).
///
/// It is decided once, at the first state the optimizer makes (after the first forward pass
/// and the gradients that grow the pages), and kept: the rule is the model's, not each
/// tensor's (a model's small state tensors left on grown pages make the holes again: `small`
/// `memwall` 161.49 MiB with only the tensors over half a page in slots), and reading the pools
/// drains the fusion stream, which at every parameter's first step split the step's fused
/// blocks (`tiny` seq 256 `all-fused`: 2 MiB more).
#[derive(Clone, Debug, Default)]
struct StatePlacement {
    in_slots: std::sync::OnceLock<bool>,
}

impl StatePlacement {
    /// What `make` makes, as the optimizer's state on `device`. Inside
    /// [`state_leaves_the_device`] it is made on the pages, and nothing is decided.
    fn make<T: Send>(&self, device: &Device, make: impl FnOnce() -> T + Send) -> T {
        if STATE_LEAVES_THE_DEVICE.get() {
            return make();
        }
        match self.in_slots.get_or_init(|| arena_has_grown(device)) {
            true => device.memory_persistent_allocations(make, |make| make()),
            false => make(),
        }
    }

    /// `N` tensors of zeros shaped and typed as `like`, made together (a persistent window
    /// drains the fusion stream, so a state's tensors share one).
    fn zeros<const N: usize, const D: usize>(&self, like: &Tensor<D>) -> [Tensor<D>; N] {
        let (shape, device, dtype) = (like.shape(), like.device(), like.dtype());
        self.make(&device, || {
            std::array::from_fn(|_| Tensor::zeros(shape.clone(), (&device, dtype)))
        })
    }

    /// One tensor of zeros shaped and typed as `like`, as [`zeros`](Self::zeros) makes them.
    fn zero<const D: usize>(&self, like: &Tensor<D>) -> Tensor<D> {
        let [zeros] = self.zeros(like);
        zeros
    }
}

thread_local! {
    /// Set while a wrapper steps an optimizer whose state it moves off the device at once.
    static STATE_LEAVES_THE_DEVICE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `step`, an optimizer's step whose new state leaves the device right after it
/// ([`HostOffloaded`]): a slot it took would stay reserved and empty (the slots are kept for a
/// later tensor of their exact size, and the state comes back on the pages), so it is made on
/// the pages (measured on lavapipe, `small` `memwall-offload`: 110.5 MiB with the first step's
/// state in slots).
fn state_leaves_the_device<T>(step: impl FnOnce() -> T) -> T {
    /// Puts the flag back as it was, also when `step` panics.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            STATE_LEAVES_THE_DEVICE.set(self.0);
        }
    }
    let _restore = Restore(STATE_LEAVES_THE_DEVICE.replace(true));
    step()
}
