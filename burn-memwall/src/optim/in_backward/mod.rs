//! [`InBackward`]; the type's docs are the description.

mod checkpoints;
mod hook;
mod learner;
mod param_at_path;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::{Dispatch, DispatchTensor};
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer, OptimizerRecord, SgdConfig};
use burn::prelude::*;
use burn::tensor::GradientCheckpointingStrategy;
use burn::tensor::kind::BridgeTensor;

use hook::{HookContext, ParamHookBackend};

use crate::host::on_device_of;
use param_at_path::ParamAtPath;

pub use checkpoints::CheckpointFiles;
pub use learner::{InBackwardTraining, StepMemory};

/// Why an in-backward step could not run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InBackwardError {
    /// The loss was computed outside autodiff.
    #[error(
        "the loss does not track gradients: build the model on an autodiff device (`device.autodiff()`)"
    )]
    NotDifferentiable,
    /// A second batch came before the first was stepped.
    #[error(
        "gradient accumulation cannot work with InBackward: each parameter is updated as soon as \
         one batch's gradient is complete, so the gradients of several batches are never summed; \
         remove the accumulation (use a bigger batch instead)"
    )]
    GradientAccumulation,
    /// burn-train's checkpointers were given to a run that writes its own.
    #[error(
        "InBackwardTraining writes and reads its own checkpoints, one tensor at a time: give the \
         folder to `InBackwardTraining::with_checkpoints` instead of checkpointers to \
         `SupervisedTraining`"
    )]
    LearnerCheckpointer,
    /// `step_deferred` with no deferred loss.
    #[error("no loss is waiting: call `InBackward::defer(loss)` in `TrainStep::step` first")]
    NothingDeferred,
    /// Parameters read in the forward pass that the stepped model does not hold.
    #[error(
        "{0} parameter(s) were read through InBackward in the forward pass but are not in the \
         model given to the step, so their updates would be lost; nothing was updated"
    )]
    ForeignParameters(usize),
}

/// How the parameters of the last step were updated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCounts {
    /// Updated during backward, right after their last use's backward step.
    pub in_backward: usize,
    /// Updated after backward: parameters read with `val()` instead of [`Routed::param`](crate::nn::Routed::param),
    /// and parameters with a use whose gradient never came (it did not reach the loss).
    pub after_backward: usize,
}

/// The decorator: a cheap, clonable handle that a model keeps (`#[module(skip)]`) to route its
/// parameters, and that runs the training step.
///
/// Optimizer steps inside `backward()`: each parameter is updated as soon as its gradient is
/// complete, and the gradient is freed right away, so the pool of one gradient per parameter
/// that standard training holds until `optimizer.step()` never forms (LOMO; PyTorch's
/// "optimizer step in backward").
///
/// [`InBackward`] decorates Burn's own [`ModuleOptimizer`]: whatever per-tensor optimizer it
/// holds (AdamW, Adam, SGD with momentum, Lion, Muon, Adafactor, …), its parameter groups,
/// per-group learning rates, per-tensor gradient clipping (`with_grad_clipping`, by value or by
/// norm) and its record all work unchanged, because each in-backward update *is* a
/// `ModuleOptimizer::step` over one parameter, seen at its path in the model.
///
/// # How a model opts in
/// In the forward pass, read each trained parameter through [`Routed::param`] with the input
/// of the layer that uses it as the *anchor*, instead of `param.val()` ([`Routed`]'s layer
/// methods do this for Burn's linear, embedding and RMSNorm and for this crate's layers):
///
/// ```ignore
/// let route = Routed::new(Some(&in_backward)); // `None`: the plain forward pass
/// let weight = route.param(&linear.weight, &x);
/// let bias = linear.bias.as_ref().map(|b| route.param(b, &x));
/// let y = burn::tensor::module::linear(x, weight, bias);
/// ```
///
/// [`Routed`]: crate::nn::Routed
/// [`Routed::param`]: crate::nn::Routed::param
///
/// The anchor only sets *when* the update runs: right after the layer's own backward step. A
/// parameter used twice (tied weights) is updated once, after both uses' gradients are summed.
/// Then train with [`InBackward::step`] instead of `loss.backward()` + `optimizer.step(..)`.
/// A parameter that is read with `val()` instead still trains, after backward, the standard way.
///
/// # Memory
/// [`InBackward::step`] takes the model by value and holds its parameters aside during
/// backward. When a parameter's update runs, the model's handle on its old value is released
/// first, so the weights are never held twice. The extra memory of an update is that parameter's
/// gradient and the optimizer's temporaries: with Burn's AdamW on Flex one more parameter-sized
/// tensor (the new weights, made before the old ones are freed), on Cube several; with
/// [`FusedAdamW`](crate::optim::FusedAdamW), [`FusedSgd`](crate::optim::FusedSgd) or
/// [`FusedLion`](crate::optim::FusedLion), which write in place, none. This needs the step to
/// own the only handle on the weights: a clone of the model kept elsewhere makes every update
/// be written beside the old weights (and leaves that clone as it was). burn-train's default
/// loop is such a case, since its `Learner` keeps its copy while it optimizes; train through
/// [`InBackwardTraining`] instead, which holds the model alone.
///
/// # What cannot work in backward
/// - Gradient accumulation: a parameter is updated as soon as one batch's gradient is complete,
///   so gradients of several batches are never summed. [`InBackward::defer`] rejects a second
///   batch before the first is stepped.
/// - Clipping by the global norm of all gradients: the norm is known only once every gradient
///   exists, which is what this removes. (Burn 0.22's `GradientClipping` is per tensor.)
/// - Distributed data parallel: the gradient never reaches the parameter, so Burn's all-reduce
///   of it never runs.
#[derive(Clone, Default)]
pub struct InBackward {
    state: Arc<Mutex<StepState>>,
}

impl std::fmt::Debug for InBackward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InBackward")
    }
}

/// `param`'s value for a forward pass, on `anchor`'s device: through `in_backward` when there
/// is one, else `param.val()`. For layers that train either way. A frozen weight kept in host
/// memory ([`super::BlockCoordinate`]'s inactive blocks) is uploaded for the read, and the copy
/// lives as long as the ops that read it keep it.
pub(crate) fn param_value<const D: usize, const A: usize>(
    in_backward: Option<&InBackward>,
    param: &Param<Tensor<D>>,
    anchor: &Tensor<A>,
) -> Tensor<D> {
    let value = match in_backward {
        Some(in_backward) => in_backward.param(param, anchor),
        None => param.val(),
    };
    on_device_of(value, anchor)
}

/// One training step from `loss`, for loops that train either way: [`InBackward::step`] when
/// `in_backward` is given, else Burn's `loss.backward()` then `optimizer.step(..)`.
pub fn train_step<M: Module, const D: usize>(
    in_backward: Option<&InBackward>,
    optimizer: &mut ModuleOptimizer,
    learning_rate: impl Into<ModuleLearningRate>,
    model: M,
    loss: Tensor<D>,
) -> Result<M, InBackwardError> {
    match in_backward {
        Some(in_backward) => in_backward.step(optimizer, learning_rate, model, loss),
        None if !loss.is_autodiff() => Err(InBackwardError::NotDifferentiable),
        None => {
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            Ok(optimizer.step(learning_rate, model, grads))
        }
    }
}

/// A parameter's use by an op outside the graph, from [`InBackward::external_use`].
#[derive(Debug)]
pub(crate) struct ExternalUse {
    id: ParamId,
    apply: hook::ApplyGradient,
    /// The parameter's value, outside autodiff: the update's input.
    value: BridgeTensor,
}

type UpdateFn = fn(&mut StepState, ParamId, BridgeTensor, BridgeTensor);

/// The gradient summed so far over the uses of a parameter that has more uses to come.
struct PartialGradient {
    value: BridgeTensor,
    gradient: BridgeTensor,
    update: UpdateFn,
}

/// A parameter taken out of the model for the duration of backward.
struct Parked {
    /// The model's handle on the old value; dropped when the update runs.
    value: Option<BridgeTensor>,
    path: Vec<(String, String)>,
    require_grad: bool,
    checkpointing: Option<GradientCheckpointingStrategy>,
}

#[derive(Default)]
struct StepState {
    /// Hook nodes created in forward passes whose backward step has not run, per parameter.
    uses: HashMap<ParamId, usize>,
    partial: HashMap<ParamId, PartialGradient>,
    parked: HashMap<ParamId, Parked>,
    updated: HashMap<ParamId, BridgeTensor>,
    /// Set only while [`InBackward::step`] runs backward.
    optimizer: Option<(ModuleOptimizer, ModuleLearningRate)>,
    deferred: Option<Tensor<1>>,
    counts: StepCounts,
    /// With [`InBackward::keep_state_per_parameter`], each in-backward parameter's optimizer
    /// state, in a `ModuleOptimizer` of its own; kept from step to step.
    per_parameter: Option<HashMap<ParamId, ModuleOptimizer>>,
}

impl StepState {
    /// Ends a step: everything goes but the optimizer state kept per parameter.
    fn reset(&mut self) {
        let per_parameter = self.per_parameter.take();
        *self = Self {
            per_parameter,
            ..Self::default()
        };
    }
}

impl InBackward {
    /// A decorator with no step running.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, StepState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `param`'s value with the hook that updates it in backward, after the backward step of
    /// the layer whose input is `anchor`; the public way in is [`crate::nn::Routed::param`],
    /// which documents it.
    pub(crate) fn param<const D: usize, const A: usize>(
        &self,
        param: &Param<Tensor<D>>,
        anchor: &Tensor<A>,
    ) -> Tensor<D> {
        // A LoRA-adapted weight (Burn's `Module::apply_lora`) trains its factors, not itself:
        // its value is Burn's `base + scale · (a @ b)` with the factors routed.
        if let Some(adapter) = param.adapter() {
            let (a, b) = (
                self.param(&adapter.a, anchor),
                self.param(&adapter.b, anchor),
            );
            let base = param.base();
            let delta = a.matmul(b).mul_scalar(adapter.scale).reshape(base.shape());
            return base + delta;
        }
        let value = param.val();
        if !(value.is_require_grad() && anchor.is_autodiff()) {
            return value;
        }
        *self.lock().uses.entry(param.id).or_default() += 1;
        let context = HookContext {
            id: param.id,
            apply: apply_gradient::<D>,
            owner: self.clone(),
        };
        Tensor::from_dispatch(Dispatch::param_hook(
            value.into_dispatch(),
            anchor.clone().into_dispatch(),
            context,
        ))
    }

    /// One training step: `loss.backward()` with every routed parameter updated by `optimizer`
    /// during it, then the standard step for any parameter that still has a gradient. Returns
    /// the updated model; no gradient is left anywhere.
    pub fn step<M: Module, const D: usize>(
        &self,
        optimizer: &mut ModuleOptimizer,
        learning_rate: impl Into<ModuleLearningRate>,
        model: M,
        loss: Tensor<D>,
    ) -> Result<M, InBackwardError> {
        if !loss.is_autodiff() {
            return Err(InBackwardError::NotDifferentiable);
        }
        let learning_rate = learning_rate.into();
        let mut state = self.lock();
        state.counts = StepCounts::default();
        let model = model.map(&mut Park {
            state: &mut state,
            path: Vec::new(),
        });
        let foreign = state
            .uses
            .keys()
            .filter(|id| !state.parked.contains_key(id))
            .count();
        if foreign > 0 {
            drop(model.map(&mut Unpark { state: &mut state }));
            state.reset();
            return Err(InBackwardError::ForeignParameters(foreign));
        }
        // The hooks need the optimizer while `backward` runs; a stateless stand-in holds its
        // place in the caller's hands meanwhile.
        let placeholder = SgdConfig::new().init();
        state.optimizer = Some((
            std::mem::replace(optimizer, placeholder),
            learning_rate.clone(),
        ));
        drop(state);
        let grads = loss.backward();

        let mut state = self.lock();
        for (id, partial) in std::mem::take(&mut state.partial) {
            (partial.update)(&mut state, id, partial.value, partial.gradient);
            state.counts.after_backward += 1;
        }
        let (taken, _) = state.optimizer.take().expect("installed above");
        *optimizer = taken;
        let model = model.map(&mut Unpark { state: &mut state });
        debug_assert!(
            state.updated.is_empty(),
            "every update has its parked parameter"
        );
        let mut counts = state.counts;
        state.reset();
        drop(state);

        let rest = GradientsParams::from_grads(grads, &model);
        let model = if rest.is_empty() {
            model
        } else {
            counts.after_backward += rest.len();
            optimizer.step(learning_rate, model, rest)
        };
        self.lock().counts = counts;
        Ok(model)
    }

    /// The learning rate that the step running now gives the parameter `id` (its group's), or
    /// `None` outside [`Self::step`]: for layers that update themselves in their own backward.
    pub(crate) fn learning_rate(&self, id: ParamId) -> Option<f64> {
        self.lock()
            .optimizer
            .as_ref()
            .map(|(_, learning_rate)| learning_rate.lr_from_param(id, None))
    }

    /// For burn-train's `TrainStep::step`: keeps `loss` for [`Self::step_deferred`], which
    /// `TrainStep::optimize` calls. Return `GradientsParams::new()` as the step's gradients.
    pub fn defer(&self, loss: Tensor<1>) -> Result<(), InBackwardError> {
        let mut state = self.lock();
        if state.deferred.is_some() {
            return Err(InBackwardError::GradientAccumulation);
        }
        state.deferred = Some(loss);
        Ok(())
    }

    /// For burn-train's `TrainStep::optimize`: [`Self::step`] on the loss kept by
    /// [`Self::defer`]. The Learner's learning rate is the one this batch would get from a
    /// standard `optimizer.step`.
    pub fn step_deferred<M: Module>(
        &self,
        optimizer: &mut ModuleOptimizer,
        learning_rate: impl Into<ModuleLearningRate>,
        model: M,
    ) -> Result<M, InBackwardError> {
        let loss = self
            .lock()
            .deferred
            .take()
            .ok_or(InBackwardError::NothingDeferred)?;
        self.step(optimizer, learning_rate, model, loss)
    }

    /// How the parameters of the last step were updated.
    pub fn last_step(&self) -> StepCounts {
        self.lock().counts
    }

    /// From now on, each parameter updated in backward keeps its optimizer state in a
    /// `ModuleOptimizer` of its own, made from the step's optimizer (its config, groups and
    /// clipping) at its first update, instead of in the step's optimizer: the step's optimizer
    /// then holds only the state of parameters updated after backward. The updates are the
    /// same (Burn's optimizers keep their state per parameter); what changes is that the state
    /// can be read and written one parameter at a time, which is how
    /// [`InBackwardTraining`]'s checkpoints write it.
    pub(crate) fn keep_state_per_parameter(&self) {
        self.lock().per_parameter.get_or_insert_with(HashMap::new);
    }

    /// Drops the optimizer state kept per parameter (it starts afresh at each parameter's next
    /// update), while no step runs: [`super::BlockCoordinate`]'s switch of blocks.
    pub(crate) fn drop_states_per_parameter(&self) {
        if let Some(states) = &mut self.lock().per_parameter {
            states.clear();
        }
    }

    /// Runs `visit` on each parameter's optimizer state kept per parameter, in the order of
    /// the parameter ids, while no step runs.
    pub(crate) fn visit_states_per_parameter<E>(
        &self,
        mut visit: impl FnMut(ParamId, &ModuleOptimizer) -> Result<(), E>,
    ) -> Result<(), E> {
        let state = self.lock();
        let Some(states) = &state.per_parameter else {
            return Ok(());
        };
        let mut ids: Vec<&ParamId> = states.keys().collect();
        ids.sort_by_key(|id| id.val());
        ids.into_iter().try_for_each(|id| visit(*id, &states[id]))
    }

    /// Replaces the optimizer state kept per parameter with `records`, each loaded into a
    /// `ModuleOptimizer` made from `template` as it comes, so that only one record is read at a
    /// time. Stops at the first error, leaving the state as it was.
    pub(crate) fn load_states_per_parameter<E>(
        &self,
        template: &ModuleOptimizer,
        records: impl IntoIterator<Item = Result<(ParamId, OptimizerRecord), E>>,
    ) -> Result<(), E> {
        let mut states = HashMap::new();
        for record in records {
            let (id, record) = record?;
            states.insert(id, without_state(template).load_record(record));
        }
        self.lock().per_parameter = Some(states);
        Ok(())
    }

    /// Whether a step is running backward, so that hooks apply updates instead of passing the
    /// gradient on.
    fn stepping(&self) -> bool {
        self.lock().optimizer.is_some()
    }

    /// Counts a use of `param` by an op that reads it outside the graph and hands its gradient
    /// over itself ([`crate::nn::ReversibleSequence`]): `None` for a frozen parameter.
    pub(crate) fn external_use<const D: usize>(
        &self,
        param: &Param<Tensor<D>>,
    ) -> Option<ExternalUse> {
        let value = param.val();
        if !value.is_require_grad() {
            return None;
        }
        *self.lock().uses.entry(param.id).or_default() += 1;
        Some(ExternalUse {
            id: param.id,
            apply: apply_gradient::<D>,
            value: value.inner().into_bridge(),
        })
    }

    /// Ends `external` with its parameter's complete `gradient` for this use: during a step,
    /// the update runs (at the parameter's last use) and `None` is returned; outside a step the
    /// gradient is handed back, for the op to give to the parameter the standard way.
    pub(crate) fn complete_external(
        &self,
        external: ExternalUse,
        gradient: DispatchTensor,
    ) -> Option<DispatchTensor> {
        if !self.stepping() {
            self.release_use(external.id);
            return Some(gradient);
        }
        (external.apply)(
            self,
            external.id,
            external.value,
            BridgeTensor::float(gradient),
        );
        None
    }

    /// A hook's backward ran outside a step: its use is over.
    fn release_use(&self, id: ParamId) {
        let mut state = self.lock();
        if let Some(uses) = state.uses.get_mut(&id) {
            *uses -= 1;
            if *uses == 0 {
                state.uses.remove(&id);
            }
        }
    }
}

/// The hook's backward step: sums the gradient over the parameter's uses and, at the last one,
/// updates the parameter.
fn apply_gradient<const D: usize>(
    owner: &InBackward,
    id: ParamId,
    value: BridgeTensor,
    gradient: BridgeTensor,
) {
    let mut state = owner.lock();
    let gradient = match state.partial.remove(&id) {
        Some(partial) => (Tensor::<D>::from_bridge(partial.gradient)
            + Tensor::<D>::from_bridge(gradient))
        .into_bridge(),
        None => gradient,
    };
    let uses = state.uses.entry(id).or_insert(1);
    *uses -= 1;
    if *uses > 0 {
        let update = update::<D>;
        state.partial.insert(
            id,
            PartialGradient {
                value,
                gradient,
                update,
            },
        );
        return;
    }
    state.uses.remove(&id);
    update::<D>(&mut state, id, value, gradient);
    state.counts.in_backward += 1;
}

/// Steps one parameter with the decorated optimizer: a `ModuleOptimizer::step` over a module
/// holding only this parameter, at its path in the model.
fn update<const D: usize>(
    state: &mut StepState,
    id: ParamId,
    value: BridgeTensor,
    gradient: BridgeTensor,
) {
    // Releasing the model's handle first leaves `value` as the only one on the old weights, so
    // the optimizer's result can take their place instead of being made beside them.
    let path = match state.parked.get_mut(&id) {
        Some(parked) => {
            parked.value = None;
            parked.path.clone()
        }
        None => Vec::new(),
    };
    let (optimizer, learning_rate) = state
        .optimizer
        .as_mut()
        .expect("updates run only while InBackward::step runs backward");
    let optimizer = match &mut state.per_parameter {
        Some(states) => states.entry(id).or_insert_with(|| without_state(optimizer)),
        None => optimizer,
    };
    let mut gradients = GradientsParams::new();
    gradients.register(id, Tensor::<D>::from_bridge(gradient));
    let single = ParamAtPath {
        path,
        // `ModuleOptimizer` expects a model's parameter: an autodiff leaf, outside any graph.
        param: Param::initialized(id, Tensor::<D>::from_bridge(value).autodiff()),
    };
    let stepped = optimizer.step(learning_rate.clone(), single, gradients);
    let value = stepped.param.into_value().inner();
    state.updated.insert(id, value.into_bridge());
}

/// `template`'s config, groups and clipping, with no state.
fn without_state(template: &ModuleOptimizer) -> ModuleOptimizer {
    template.clone().load_record(OptimizerRecord::default())
}

/// Takes every parameter that has a pending hook out of the model, so that during backward the
/// hook holds the only handle on its old value.
struct Park<'a> {
    state: &'a mut StepState,
    path: Vec<(String, String)>,
}

impl ModuleMapper for Park<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push((name.into(), container_type.into()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.state.uses.contains_key(&param.id) {
            return param;
        }
        let (id, value, mapper) = param.consume();
        let placeholder = Tensor::<D>::zeros([1; D], &value.device());
        self.state.parked.insert(
            id,
            Parked {
                require_grad: value.is_require_grad(),
                checkpointing: value.gradient_checkpointing_strategy(),
                value: Some(value.into_bridge()),
                path: self.path.clone(),
            },
        );
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts the parked parameters back: the updated value where there is one (with the parameter's
/// autodiff settings), else the old one.
struct Unpark<'a> {
    state: &'a mut StepState,
}

impl ModuleMapper for Unpark<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(parked) = self.state.parked.remove(&param.id) else {
            return param;
        };
        let (id, _placeholder, mapper) = param.consume();
        let value = match (self.state.updated.remove(&id), parked.value) {
            (Some(updated), _) => {
                let mut value = Tensor::<D>::from_inner(Tensor::from_bridge(updated));
                if let Some(strategy) = parked.checkpointing {
                    value = value.with_gradient_checkpointing_strategy(strategy);
                }
                if parked.require_grad {
                    value = value.require_grad();
                }
                value
            }
            (None, Some(old)) => Tensor::from_bridge(old),
            (None, None) => unreachable!("a parked value is released only by its update"),
        };
        Param::from_mapped_value(id, value, mapper)
    }
}
