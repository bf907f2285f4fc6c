//! Training weights stored in bf16 or f16: decorators around any per-tensor `Optimizer` (Burn's
//! or this crate's, after backward or through [`crate::optim::InBackward`]).
//!
//! Both step the wrapped optimizer in f32: the gradient is cast up, so the optimizer's state
//! (AdamW's moments) is f32 too. They differ in where the f32 result goes:
//!
//! - [`MasterWeights`] keeps an f32 copy of each weight in its state, updates that copy and
//!   gives the model the copy rounded to the nearest half-precision value: mixed-precision
//!   training as Micikevicius et al. (2018) define it, 4 more bytes per weight.
//! - [`StochasticRounding`] updates the half-precision weight itself in f32 and rounds the
//!   result stochastically back (`burn_memwall_codes::rounding`): no copy, and an update far
//!   below the weight's spacing still moves it in expectation, where rounding to the nearest
//!   would drop it (bf16 has 8 significant bits: at a weight of 1, any update under 2⁻⁹ is
//!   lost).
//!
//! An f32 weight passes through either one unchanged in meaning (the master is the weight).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource, join_path};
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::FloatDType;
use burn_memwall_codes::hash::{draw_key, pcg_hash};
use serde::{Deserialize, Serialize};

use crate::ops::stochastic_rounding::{half_format, round_stochastically};

/// How weights stored in half precision take their updates (see the module's docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HalfPrecisionUpdate {
    /// An f32 master copy per weight ([`MasterWeights`]).
    Masters,
    /// The half-precision weight rounded stochastically after each update
    /// ([`StochasticRounding`]).
    StochasticRounding,
}

/// `inner`, stepping an f32 master copy of each weight that its state keeps; the weight is the
/// master rounded to its own dtype.
#[derive(Clone, Debug)]
pub struct MasterWeights<O> {
    inner: O,
}

impl<O> MasterWeights<O> {
    /// `inner` with master weights.
    pub fn new(inner: O) -> Self {
        Self { inner }
    }
}

/// [`MasterWeights`]' state of one parameter: its f32 master and the wrapped optimizer's state.
#[derive(Clone)]
pub struct MasterWeightsState<S, const D: usize> {
    /// The weight in f32.
    pub master: Tensor<D>,
    /// The wrapped optimizer's state.
    pub inner: Option<S>,
}

impl<O: Optimizer> Optimizer for MasterWeights<O> {
    type State<const D: usize> = MasterWeightsState<O::State<D>, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let dtype = tensor.dtype();
        let (master, inner) = match state {
            Some(MasterWeightsState { master, inner }) => (master, inner),
            None => (tensor.cast(FloatDType::F32), None),
        };
        let (master, inner) = self
            .inner
            .step(lr, master, grad.cast(FloatDType::F32), inner);
        let tensor = master.clone().cast(dtype);
        (tensor, Some(MasterWeightsState { master, inner }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        MasterWeightsState {
            master: state.master.to_device(device),
            inner: state.inner.map(|inner| O::to_device(inner, device)),
        }
    }
}

impl<S: RecordState, const D: usize> RecordState for MasterWeightsState<S, D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_tensor(prefix, "master", self.master.to_data());
        if let Some(inner) = &self.inner {
            inner.state_flatten(&join_path(prefix, "inner"), out);
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let master = Tensor::from_data(src.take_tensor(prefix, "master")?, device);
        let inner_prefix = join_path(prefix, "inner");
        let inner = match src.has_under(&inner_prefix) {
            true => Some(S::state_unflatten(&inner_prefix, src, device)?),
            false => None,
        };
        Some(Self { master, inner })
    }
}

/// `inner`, stepping each weight in f32 and rounding the result stochastically back to the
/// weight's dtype (bf16 or f16; an f32 weight is `inner`'s result as it is). Each parameter's
/// roundings draw from the hash under its own salt and step, both in its state: a resumed run
/// rounds as the uninterrupted one.
#[derive(Clone, Debug)]
pub struct StochasticRounding<O> {
    inner: O,
    seed: u32,
    /// Counts the parameters whose state this optimizer (and its clones) started: each one's
    /// salt. The order in which a model's parameters first step does not change between runs.
    started: Arc<AtomicU32>,
}

impl<O> StochasticRounding<O> {
    /// `inner` with roundings drawn under `seed`.
    pub fn new(inner: O, seed: u32) -> Self {
        Self {
            inner,
            seed,
            started: Arc::new(AtomicU32::new(0)),
        }
    }
}

/// [`StochasticRounding`]'s state of one parameter.
#[derive(Clone)]
pub struct StochasticRoundingState<S> {
    /// Tells this parameter's roundings apart from the others'.
    pub salt: u32,
    /// Updates so far (the current one's, during a step).
    pub step: u32,
    /// The wrapped optimizer's state.
    pub inner: Option<S>,
}

impl<O: Optimizer> Optimizer for StochasticRounding<O> {
    type State<const D: usize> = StochasticRoundingState<O::State<D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let dtype = tensor.dtype();
        let (salt, step, inner) = match state {
            Some(state) => (state.salt, state.step.wrapping_add(1), state.inner),
            None => {
                let index = self.started.fetch_add(1, Ordering::Relaxed);
                (pcg_hash(self.seed ^ pcg_hash(index)), 1, None)
            }
        };
        let (updated, inner) = self.inner.step(
            lr,
            tensor.cast(FloatDType::F32),
            grad.cast(FloatDType::F32),
            inner,
        );
        let tensor = match half_format(dtype) {
            Some(_) => round_stochastically(updated, dtype.into(), draw_key(salt, step)),
            None => updated.cast(dtype),
        };
        (tensor, Some(StochasticRoundingState { salt, step, inner }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        StochasticRoundingState {
            inner: state.inner.map(|inner| O::to_device(inner, device)),
            ..state
        }
    }
}

impl<S: RecordState> RecordState for StochasticRoundingState<S> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "salt", Scalar::UInt(self.salt.into()));
        out.push_scalar(prefix, "step", Scalar::UInt(self.step.into()));
        if let Some(inner) = &self.inner {
            inner.state_flatten(&join_path(prefix, "inner"), out);
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let scalar = |src: &mut StateSource, leaf| match src.take_scalar(prefix, leaf)? {
            Scalar::UInt(value) => u32::try_from(value).ok(),
            _ => None,
        };
        let (salt, step) = (scalar(src, "salt")?, scalar(src, "step")?);
        let inner_prefix = join_path(prefix, "inner");
        let inner = match src.has_under(&inner_prefix) {
            true => Some(S::state_unflatten(&inner_prefix, src, device)?),
            false => None,
        };
        Some(Self { salt, step, inner })
    }
}
