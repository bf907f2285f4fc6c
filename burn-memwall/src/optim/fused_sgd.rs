//! [`FusedSgd`]; the type's docs are the description.

use burn::config::Config;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::momentum::{MomentumConfig, MomentumState};
use burn::optim::{
    LearningRate, ModuleOptimizer, Optimizer, RecordState, SgdState, StateSink, StateSource,
    join_path,
};
use burn::prelude::*;

use super::{FusedState, StatePlacement, StateTensors, with_clipping};
use crate::ops::momentum_update::{MomentumStep, momentum_update, sgd_update};

/// [`FusedSgd`]'s settings, with the meaning of `burn::optim::SgdConfig`'s.
#[derive(Config, Debug)]
pub struct FusedSgdConfig {
    /// Momentum, dampening and Nesterov, as `burn::optim::SgdConfig`'s; none is plain SGD,
    /// which has no state.
    pub momentum: Option<MomentumConfig>,
    /// L2 penalty added to the gradient (coupled weight decay, as in Burn's SGD).
    pub weight_decay: Option<WeightDecayConfig>,
    /// Per-tensor clipping, applied by the `ModuleOptimizer` that [`Self::init`] returns.
    pub grad_clipping: Option<GradientClippingConfig>,
}

/// SGD whose per-parameter step is one fused, in-place pass (`ops/momentum_update`). The math
/// is `burn::optim::Sgd`'s, and its state is saved under the names of Burn's `SgdState` (a
/// checkpoint of either loads into the other). Burn's step makes its result in another buffer
/// (with momentum about four parameter-sized temporaries beside it); this one writes the
/// weights, and the velocity with momentum, where they are when nothing else holds them. On
/// Cube devices that keeps each parameter in its persistent slot: Burn's SGD moves it out and
/// leaves the slot reserved and empty, the parameters then held twice.
#[derive(Clone, Debug)]
pub struct FusedSgd {
    momentum: Option<MomentumConfig>,
    l2: f32,
    velocity: StatePlacement,
}

/// The velocity of one parameter.
#[derive(Clone, Debug)]
pub struct FusedSgdState<const D: usize> {
    /// The momentum buffer, the parameter's shape.
    pub velocity: Tensor<D>,
}

impl FusedSgdConfig {
    /// The per-tensor optimizer, e.g. for `ModuleOptimizer::with_group`.
    pub fn build(&self) -> FusedSgd {
        FusedSgd {
            momentum: self.momentum.clone(),
            l2: self
                .weight_decay
                .as_ref()
                .map_or(0.0, |decay| decay.penalty),
            velocity: StatePlacement::default(),
        }
    }

    /// The whole-module optimizer, with the configured clipping.
    pub fn init(&self) -> ModuleOptimizer {
        with_clipping(self.build(), self.grad_clipping.as_ref())
    }
}

impl Optimizer for FusedSgd {
    type State<const D: usize> = FusedState<FusedSgdState<D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let Some(momentum) = &self.momentum else {
            return (sgd_update(tensor, grad, self.l2, lr), None);
        };
        let first = state.is_none();
        // The first step's velocity is the gradient itself: the zeros are only read as `0·m`.
        let velocity = match state {
            Some(state) => self.velocity.place(state, &grad.device()).velocity,
            None => self.velocity.zero(&grad),
        };
        let step = MomentumStep::sgd(lr, self.l2, momentum, first);
        let (tensor, velocity) = momentum_update(tensor, grad, velocity, step);
        (tensor, Some(FusedState::Placed(FusedSgdState { velocity })))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        state.to_device(device)
    }
}

impl<const D: usize> StateTensors for FusedSgdState<D> {
    fn to_device(mut self, device: &Device) -> Self {
        self.velocity = self.velocity.to_device(device);
        self
    }
}

/// Saved as Burn's `SgdState` with momentum saves itself, so that records interchange.
impl<const D: usize> RecordState for FusedSgdState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        SgdState::new(Some(MomentumState::new(self.velocity.clone()))).state_flatten(prefix, out);
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let data = src.take_tensor(&join_path(prefix, "momentum"), "velocity")?;
        Some(Self {
            velocity: Tensor::from_data(data, device),
        })
    }
}
