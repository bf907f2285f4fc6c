//! Dynamic loss scaling for weights and gradients stored in f16.
//!
//! f16's smallest positive number is 2⁻²⁴ (6·10⁻⁸; 2⁻¹⁴ is its smallest with full precision):
//! a language model's gradients, means over thousands of tokens, fall below it and flush to
//! zero. The backward pass of `S·loss` computes `S·∂loss/∂θ` instead, in range, and the update
//! divides it by `S` again in f32 ([`LossScaled`]). Too large an `S` overflows a gradient to
//! infinity: that parameter's update is skipped and `S` halves; after
//! [`LossScaleConfig::growth_interval`] steps without an overflow it doubles (the rule of
//! Micikevicius et al. (2018), with PyTorch's `GradScaler` growth interval). Scales are powers
//! of two, so scaling and unscaling change no bit of a gradient that neither underflows nor
//! overflows.
//!
//! The check is per parameter, because an update that runs during backward
//! ([`crate::optim::InBackward`]) cannot wait for the rest of the gradients: a step that
//! overflows updates the parameters whose gradients were finite and skips the others, where
//! `GradScaler` after backward would skip them all (LOMO, which also updates in backward,
//! skips the updates from the first overflow on). Each check reads one flag back to the host.

use std::sync::{Arc, Mutex};

use burn::config::Config;
use burn::optim::{LearningRate, Optimizer};
use burn::prelude::*;
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

/// The largest scale: the backward pass starts from the scale itself as the loss's gradient,
/// and 2¹⁵ is the largest power of two f16 holds (its largest number is 65504).
pub const MAX_LOSS_SCALE: f32 = 32768.0;

/// Configuration of a [`LossScale`].
#[derive(Config, Debug, PartialEq)]
pub struct LossScaleConfig {
    /// The first step's scale: a power of two, at most [`MAX_LOSS_SCALE`].
    #[config(default = 32768.0)]
    pub initial_scale: f32,
    /// Steps without an overflow after which the scale doubles (up to [`MAX_LOSS_SCALE`]).
    #[config(default = 2000)]
    pub growth_interval: u32,
}

/// Why a [`LossScaleConfig`] is refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LossScaleError {
    /// Not a power of two, or above [`MAX_LOSS_SCALE`].
    #[error(
        "the initial loss scale must be a power of two of at most {MAX_LOSS_SCALE} (scaling by \
         powers of two is exact), got {0}"
    )]
    InitialScale(f32),
    /// A growth interval of 0 steps.
    #[error("the loss scale's growth interval must be at least one step")]
    GrowthInterval,
}

impl LossScaleConfig {
    /// The loss scale, at its initial value.
    ///
    /// # Errors
    /// An initial scale that is not a normal power of two of at most 2¹⁵, or an interval of 0.
    pub fn try_init(&self) -> Result<LossScale, LossScaleError> {
        let scale = self.initial_scale;
        if !(scale.is_normal()
            && scale > 0.0
            && scale <= MAX_LOSS_SCALE
            && scale.to_bits() & 0x7f_ffff == 0)
        {
            return Err(LossScaleError::InitialScale(scale));
        }
        if self.growth_interval == 0 {
            return Err(LossScaleError::GrowthInterval);
        }
        Ok(LossScale {
            growth_interval: self.growth_interval,
            state: Arc::new(Mutex::new(LossScaleRecord {
                scale,
                steps_since_change: 0,
                skipped_updates: 0,
            })),
        })
    }

    /// [`Self::try_init`] for a config known to be valid.
    ///
    /// # Panics
    /// Where [`Self::try_init`] fails.
    pub fn init(&self) -> LossScale {
        self.try_init().unwrap_or_else(|error| panic!("{error}"))
    }
}

/// The scale of the loss, shared by the training step that scales the loss
/// ([`Self::scale`]), the optimizer that unscales the gradients ([`LossScaled`]) and the loop
/// that ends each step ([`Self::end_step`]). Clones share one scale.
#[derive(Clone, Debug)]
pub struct LossScale {
    growth_interval: u32,
    state: Arc<Mutex<LossScaleRecord>>,
}

/// A [`LossScale`]'s state between steps: what a checkpoint keeps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleRecord {
    /// The scale of the next step's loss.
    pub scale: f32,
    /// Steps since the scale last changed, or during a step `u32::MAX` once an update of it
    /// overflowed.
    pub steps_since_change: u32,
    /// Parameter updates skipped for an overflow since training started.
    pub skipped_updates: u64,
}

/// `steps_since_change` within a step that overflowed.
const OVERFLOWED: u32 = u32::MAX;

impl LossScale {
    /// `loss` in f32 times the scale: the loss whose backward pass gives scaled gradients.
    pub fn scale<const D: usize>(&self, loss: Tensor<D>) -> Tensor<D> {
        loss.cast(FloatDType::F32).mul_scalar(self.value())
    }

    /// The current scale.
    pub fn value(&self) -> f32 {
        self.lock().scale
    }

    /// Ends a step: halves the scale if one of its updates overflowed, doubles it after
    /// `growth_interval` steps that did not.
    pub fn end_step(&self) {
        let mut state = self.lock();
        if state.steps_since_change == OVERFLOWED {
            state.scale /= 2.0;
            state.steps_since_change = 0;
            return;
        }
        state.steps_since_change += 1;
        if state.steps_since_change >= self.growth_interval {
            state.scale = (state.scale * 2.0).min(MAX_LOSS_SCALE);
            state.steps_since_change = 0;
        }
    }

    /// The state between steps, for a checkpoint.
    pub fn to_record(&self) -> LossScaleRecord {
        *self.lock()
    }

    /// Continues from `record` (a resumed run).
    pub fn load_record(&self, record: LossScaleRecord) {
        *self.lock() = record;
    }

    /// Marks the current step as overflowed.
    fn overflowed(&self) {
        let mut state = self.lock();
        state.steps_since_change = OVERFLOWED;
        state.skipped_updates += 1;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LossScaleRecord> {
        self.state.lock().expect("loss scale lock")
    }
}

/// `inner`, given gradients of a loss scaled by `scale`: it divides each gradient by the scale
/// in f32 and steps `inner` with it, or leaves the parameter and its state as they are when the
/// gradient is not finite (see the module's docs).
#[derive(Clone, Debug)]
pub struct LossScaled<O> {
    inner: O,
    scale: LossScale,
}

impl<O> LossScaled<O> {
    /// `inner` on gradients of losses scaled by `scale`.
    pub fn new(inner: O, scale: LossScale) -> Self {
        Self { inner, scale }
    }
}

impl<O: Optimizer> Optimizer for LossScaled<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let grad = grad.cast(FloatDType::F32).div_scalar(self.scale.value());
        let finite = grad.clone().is_finite().all().into_scalar::<bool>();
        if !finite {
            self.scale.overflowed();
            return (tensor, state);
        }
        self.inner.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        O::to_device(state, device)
    }
}
