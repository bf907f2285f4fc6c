//! [`FusedAdamW`]; the type's docs are the description.

use burn::config::Config;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate, ModuleOptimizer, Optimizer};
use burn::prelude::*;

use super::{FusedState, StatePlacement, StateTensors, with_clipping};
use crate::ops::adamw_update::{AdamWStep, adamw_update};

/// [`FusedAdamW`]'s settings, with `burn::optim::AdamWConfig`'s names and defaults (without
/// AMSGrad and cautious weight decay).
#[derive(Config, Debug)]
pub struct FusedAdamWConfig {
    /// `β₁`: decay of the first moment.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// `β₂`: decay of the second moment.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// `ε`: added to the second moment's square root.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// Decoupled weight decay.
    #[config(default = 1e-4)]
    pub weight_decay: f32,
    /// Per-tensor clipping, applied by the `ModuleOptimizer` that [`Self::init`] returns.
    pub grad_clipping: Option<GradientClippingConfig>,
}

/// AdamW whose per-parameter step is one fused, in-place pass (`ops/adamw_update`).
/// The math, the state (in a [`FusedState`]) and its record are Burn's `AdamW`'s (a checkpoint
/// of either loads into the other); what changes is memory and time: Burn's step allocates about
/// five parameter-sized temporaries and makes the new weights beside the old ones, this one
/// writes the weights and both moments where they are when nothing else holds them.
#[derive(Clone, Debug)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// Where the moments are made ([`LowBitAdamW`](super::LowBitAdamW)'s too).
    pub(super) state: StatePlacement,
}

impl FusedAdamWConfig {
    /// The per-tensor optimizer, e.g. for `ModuleOptimizer::with_group`.
    pub fn build(&self) -> FusedAdamW {
        FusedAdamW {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            state: StatePlacement::default(),
        }
    }

    /// The whole-module optimizer, with the configured clipping.
    pub fn init(&self) -> ModuleOptimizer {
        with_clipping(self.build(), self.grad_clipping.as_ref())
    }
}

impl FusedAdamW {
    /// The scalars of step `time` (counted from 1) at learning rate `lr`.
    pub(crate) fn scalars(&self, lr: LearningRate, time: usize) -> AdamWStep {
        AdamWStep::new(
            lr,
            time,
            self.beta_1,
            self.beta_2,
            self.epsilon,
            self.weight_decay,
        )
    }
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = FusedState<AdamWState<D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        // No state yet is both moments at zero: the first update gives Burn's initial moments.
        let state = state.map(|state| self.state.place(state, &grad.device()));
        let (time, moment_1, moment_2) = match state {
            Some(AdamWState { momentum }) => {
                (momentum.time + 1, momentum.moment_1, momentum.moment_2)
            }
            None => {
                let [moment_1, moment_2] = self.state.zeros(&grad);
                (1, moment_1, moment_2)
            }
        };
        let step = self.scalars(lr, time);
        let (tensor, moment_1, moment_2) = adamw_update(tensor, grad, moment_1, moment_2, step);
        let momentum = AdaptiveMomentumState::new(time, moment_1, moment_2);
        (tensor, Some(FusedState::Placed(AdamWState::new(momentum))))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        state.to_device(device)
    }
}

impl<const D: usize> StateTensors for AdamWState<D> {
    fn to_device(mut self, device: &Device) -> Self {
        self.momentum = self.momentum.to_device(device);
        self
    }
}
