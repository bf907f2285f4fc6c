//! [`FusedLion`]; the type's docs are the description.

use burn::config::Config;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{LearningRate, LionState, ModuleOptimizer, Optimizer};
use burn::prelude::*;

use super::{FusedState, StatePlacement, StateTensors, with_clipping};
use crate::ops::momentum_update::{MomentumStep, momentum_update};

/// [`FusedLion`]'s settings, with `burn::optim::LionConfig`'s names and defaults.
#[derive(Config, Debug)]
pub struct FusedLionConfig {
    /// `β₁`: the interpolation that gives the update's sign.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// `β₂`: decay of the momentum.
    #[config(default = 0.99)]
    pub beta_2: f32,
    /// Decoupled weight decay.
    #[config(default = 0.0)]
    pub weight_decay: f32,
    /// Per-tensor clipping, applied by the `ModuleOptimizer` that [`Self::init`] returns.
    pub grad_clipping: Option<GradientClippingConfig>,
}

/// Lion whose per-parameter step is one fused, in-place pass
/// (`ops/momentum_update`). The math, the state (in a [`FusedState`]) and its record are
/// `burn::optim::Lion`'s (a checkpoint of either loads into the other); Burn's step makes about
/// five parameter-sized temporaries and the new weights beside the old ones, this one writes the
/// weights and the moment where they are when nothing else holds them.
#[derive(Clone, Debug)]
pub struct FusedLion {
    beta_1: f32,
    beta_2: f32,
    weight_decay: f32,
    moment: StatePlacement,
}

impl FusedLionConfig {
    /// The per-tensor optimizer, e.g. for `ModuleOptimizer::with_group`.
    pub fn build(&self) -> FusedLion {
        FusedLion {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            weight_decay: self.weight_decay,
            moment: StatePlacement::default(),
        }
    }

    /// The whole-module optimizer, with the configured clipping.
    pub fn init(&self) -> ModuleOptimizer {
        with_clipping(self.build(), self.grad_clipping.as_ref())
    }
}

impl Optimizer for FusedLion {
    type State<const D: usize> = FusedState<LionState<D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        // No state yet is a zero moment: the formula then gives Burn's first step.
        let moment = match state {
            Some(state) => self.moment.place(state, &grad.device()).momentum,
            None => self.moment.zero(&grad),
        };
        let step = MomentumStep::lion(lr, self.beta_1, self.beta_2, self.weight_decay);
        let (tensor, momentum) = momentum_update(tensor, grad, moment, step);
        (tensor, Some(FusedState::Placed(LionState::new(momentum))))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        state.to_device(device)
    }
}

impl<const D: usize> StateTensors for LionState<D> {
    fn to_device(mut self, device: &Device) -> Self {
        self.momentum = self.momentum.to_device(device);
        self
    }
}
