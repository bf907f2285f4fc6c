//! [`BlockCoordinate`]; the type's docs are the description.

use std::collections::HashSet;

use burn::config::Config;
use burn::module::{Module, ModuleMapper, Param, ParamGroup};
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use super::{HostOffloadError, InBackward, refuse_host};
use crate::host::{read_back, same_memory, upload};

/// The order in which [`BlockCoordinate`] visits the blocks, pass after pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockOrder {
    /// The blocks as listed, first to last.
    Ascending,
    /// Last to first: BAdam's default (for a transformer listed from the input up, the layers
    /// nearest the output first).
    Descending,
    /// A new random permutation of the blocks for each pass, drawn from the seed and the pass's
    /// number (so a resumed run draws the same ones).
    Random {
        /// Seeds every pass's permutation.
        seed: u64,
    },
}

/// What [`BlockCoordinate`] does with a block's optimizer state when the block's turn ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum InactiveState {
    /// Dropped: each turn starts from a fresh state (BAdam's), and only the active block's
    /// state ever exists.
    #[default]
    Dropped,
    /// Kept where the optimizer keeps it, for the block's next turn to continue: in host memory
    /// with [`HostOffloaded`](super::HostOffloaded), on the device (no memory saved) without.
    Kept,
}

/// [`BlockCoordinate`]'s settings: the blocks, how long each trains, in which order.
#[derive(Config, Debug)]
pub struct BlockCoordinateConfig {
    /// The blocks of parameters trained one at a time, by their paths in the model as Burn's
    /// `ParamGroup`s (e.g. `ParamGroup::from_regex(r"^layers\.3\.")`). A parameter in no block
    /// and not in [`Self::always`] stays frozen; one in several trains with each.
    pub blocks: Vec<ParamGroup>,
    /// Steps each block trains before the next one takes over (BAdam's `switch_block_every`).
    #[config(default = 50)]
    pub switch_every: usize,
    /// The order of the blocks in each pass.
    #[config(default = "BlockOrder::Descending")]
    pub order: BlockOrder,
    /// Parameters that train at every step beside the active block (BAdam's `active_modules`);
    /// their optimizer state is dropped or kept with the blocks'.
    pub always: Option<ParamGroup>,
    /// What happens to a block's optimizer state when its turn ends.
    #[config(default = "InactiveState::Dropped")]
    pub inactive_state: InactiveState,
    /// Parameters that stay on the device while their block is not training, when the other
    /// blocks' weights are in host memory ([`BlockCoordinate::with_inactive_weights_on_host`]):
    /// a weight that two blocks' computations read, such as a token table tied to the head,
    /// would otherwise cross to the device twice per step.
    pub pinned: Option<ParamGroup>,
}

/// Why a [`BlockCoordinateConfig`] cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockCoordinateError {
    /// [`BlockCoordinateConfig::blocks`] is empty.
    #[error("block-coordinate training needs at least one block")]
    NoBlocks,
    /// [`BlockCoordinateConfig::switch_every`] is 0.
    #[error("each block must train for at least one step before the next (switch_every = 0)")]
    ZeroSwitchEvery,
}

impl BlockCoordinateConfig {
    /// The schedule at its first step.
    ///
    /// # Errors
    /// No blocks, or `switch_every` = 0.
    pub fn init(&self) -> Result<BlockCoordinate, BlockCoordinateError> {
        if self.blocks.is_empty() {
            return Err(BlockCoordinateError::NoBlocks);
        }
        if self.switch_every == 0 {
            return Err(BlockCoordinateError::ZeroSwitchEvery);
        }
        Ok(BlockCoordinate {
            config: self.clone(),
            steps: 0,
            trainable: None,
            weights_home: None,
        })
    }
}

/// What a [`BlockCoordinate`] keeps between steps: what a checkpoint saves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCoordinateRecord {
    /// Steps begun since training started.
    pub steps: u64,
}

/// Block-coordinate training (BAdam, Luo et al. 2024): the model's parameters are split into
/// blocks, and one block trains at a time, for [`BlockCoordinateConfig::switch_every`] steps,
/// while every other parameter is frozen.
///
/// It decorates any `ModuleOptimizer`, stepped after backward or by an [`InBackward`]:
/// before each step's forward pass, [`Self::begin_step`] freezes every parameter outside the
/// active block (`require_grad` off, as a frozen parameter: autodiff computes no gradient for
/// it, and below the lowest trained layer no backward runs at all) and, at a switch, drops the
/// optimizer state, so that only the active block's state ever exists (BAdam builds a new base
/// optimizer state at each switch), or keeps it ([`InactiveState::Kept`]: with
/// [`HostOffloaded`](super::HostOffloaded), in host memory). The learning rate is the run's
/// schedule, uninterrupted by the switches, as in BAdam; the optimizer's own step count
/// (AdamW's bias correction) starts again with a fresh state and continues with a kept one.
///
/// # Memory
/// With the state dropped, the optimizer state of the largest block instead of the whole
/// model's; the gradients of one block either way. Weights stay on the device, unless
/// [`Self::with_inactive_weights_on_host`] keeps those of the blocks not training in host
/// memory: each read of one (through [`Routed`](crate::nn::Routed)) then uploads a copy that
/// lives as long as the ops that read it keep it. Below the training block no backward runs,
/// so a copy is freed once read; with [`ReversibleSequence`](crate::nn::ReversibleSequence) the
/// backward recomputes one block at a time, so a block's copies live through its own
/// recomputation only; in a standard stack, the layers above the training block keep theirs
/// until their backward step.
///
/// # Resuming
/// The schedule is a function of the step count alone, which [`Self::to_record`] keeps: a run
/// resumed with its checkpointed optimizer state (the active block's) continues exactly.
/// [`InBackwardTraining::with_block_coordinate`](super::InBackwardTraining::with_block_coordinate)
/// does this through burn-train's `Learner`.
#[derive(Clone, Debug)]
pub struct BlockCoordinate {
    config: BlockCoordinateConfig,
    steps: u64,
    /// The paths of the parameters that trained before the first step (the rest were frozen
    /// by the user, e.g. a LoRA base): a block never unfreezes those. Paths, not ids: loading a
    /// record gives the parameters the record's ids.
    trainable: Option<HashSet<String>>,
    /// Where the weights of the training block live when those of the others are in host
    /// memory.
    weights_home: Option<Device>,
}

impl BlockCoordinate {
    /// Keeps the weights of the blocks not training in host memory (Flex), and those of the
    /// training block, [`BlockCoordinateConfig::always`] and [`BlockCoordinateConfig::pinned`]
    /// on `device`: [`Self::begin_step`] moves a block's weights out when its turn ends (read
    /// back a chunk of rows at a time) and back when it begins.
    ///
    /// # Errors
    /// [`HostOffloadError::HostIsTheDevice`] for a device that computes in host memory (Flex,
    /// CubeCL's CPU runtime).
    pub fn with_inactive_weights_on_host(
        mut self,
        device: &Device,
    ) -> Result<Self, HostOffloadError> {
        refuse_host(device)?;
        self.weights_home = Some(device.clone());
        Ok(self)
    }

    /// Whether the weights of the blocks not training wait in host memory
    /// ([`Self::with_inactive_weights_on_host`]).
    pub fn keeps_inactive_weights_on_host(&self) -> bool {
        self.weights_home.is_some()
    }

    /// The index in [`BlockCoordinateConfig::blocks`] of the block that trains at `step`
    /// (counted from 0).
    pub fn block_at(&self, step: u64) -> usize {
        let count = self.config.blocks.len() as u64;
        let turn = step / self.config.switch_every as u64;
        let (pass, slot) = (turn / count, (turn % count) as usize);
        match self.config.order {
            BlockOrder::Ascending => slot,
            BlockOrder::Descending => count as usize - 1 - slot,
            BlockOrder::Random { seed } => {
                let mut order: Vec<usize> = (0..count as usize).collect();
                order.shuffle(&mut StdRng::seed_from_u64(
                    seed ^ pass.wrapping_mul(PASS_MIX),
                ));
                order[slot]
            }
        }
    }

    /// The block that trains at the next step.
    pub fn active_block(&self) -> usize {
        self.block_at(self.steps)
    }

    /// Starts the next step: freezes every parameter of `model` outside the active block (and
    /// [`BlockCoordinateConfig::always`]) and, at the first step of a block, drops the
    /// optimizer state of the one before (unless it is [`InactiveState::Kept`]), from
    /// `optimizer` and from `in_backward` when it keeps state per parameter
    /// ([`super::InBackwardTraining`]'s runs do). With the inactive weights in host memory, moves
    /// the weights of the block whose turn ended there and brings the active block's back. At a
    /// switch, gives the device back the pages its pools hold empty. Call it before the forward
    /// pass, which is when autodiff reads `require_grad`.
    pub fn begin_step<M: Module>(
        &mut self,
        model: M,
        optimizer: &mut ModuleOptimizer,
        in_backward: Option<&InBackward>,
    ) -> M {
        let switch_every = self.config.switch_every as u64;
        let switch = self.steps > 0 && self.steps.is_multiple_of(switch_every);
        if switch && self.config.inactive_state == InactiveState::Dropped {
            *optimizer = optimizer.clone().load_record(OptimizerRecord::default());
            if let Some(in_backward) = in_backward {
                in_backward.drop_states_per_parameter();
            }
        }
        let (model, device) = self.arrange(model, true);
        // The turn that ended leaves pages sized for its tensors (its state, its gradients, its
        // weights' copies) reserved in a Cube device's pools; the new block's tensors of other
        // sizes would open pages beside them, and the device would hold every turn's pages at
        // once. (Measured on lavapipe, `small` with the waiting weights in host memory: 70.5
        // MiB reserved after the table's first forward, 33.3 MiB with them released.)
        if let (true, Some(device)) = (switch, device) {
            // After the frees queued before it (the dropped state's, the moved weights'). A
            // device that failed says so at the step's first read.
            let _ = device.sync();
            device.memory_cleanup();
        }
        self.steps += 1;
        model
    }

    /// `model` with each weight where the next step wants it: a model built on the device (its
    /// parameters drawn lazily, at their first read) has them drawn here one at a time, each
    /// moved to host memory at once when its block waits, so that the device never holds every
    /// weight. Call it on a fresh model before a run, and before a checkpoint's record loads
    /// (which each parameter does where it is). Nothing is frozen here, and which parameters
    /// train at all is read at the first [`Self::begin_step`] (until then they may still be
    /// frozen). Without the inactive weights in host memory, `model` is returned as it is.
    pub fn place<M: Module>(&mut self, model: M) -> M {
        match self.weights_home {
            Some(_) => self.arrange(model, false).0,
            None => model,
        }
    }

    /// With a `weights_home`, places every parameter for the step `self.steps`; with `freeze`,
    /// sets `require_grad` for it too, and the first such call records which parameters train
    /// at all. Returns the model and the device the training block is on.
    fn arrange<M: Module>(&mut self, model: M, freeze: bool) -> (M, Option<Device>) {
        let active = self.block_at(self.steps);
        let mut unrecorded = HashSet::new();
        let first_call = self.trainable.is_none();
        let trainable = match (freeze, &mut self.trainable) {
            (true, trainable) => trainable.get_or_insert_with(HashSet::new),
            (false, Some(trainable)) => trainable,
            (false, None) => &mut unrecorded,
        };
        let mut mapper = Freeze {
            active: &self.config.blocks[active],
            always: self.config.always.as_ref(),
            pinned: self.config.pinned.as_ref(),
            weights_home: self.weights_home.as_ref(),
            trainable,
            first_call,
            freeze,
            path: Vec::new(),
            device: None,
        };
        let model = model.map(&mut mapper);
        (model, mapper.device)
    }

    /// `model` with every weight back on the device, for use after training: with the inactive
    /// weights in host memory, the blocks not training at the last step keep theirs there.
    pub fn end<M: Module>(&self, model: M) -> M {
        match &self.weights_home {
            Some(home) => model.map(&mut Home(home)),
            None => model,
        }
    }

    /// The step count, for a checkpoint.
    pub fn to_record(&self) -> BlockCoordinateRecord {
        BlockCoordinateRecord { steps: self.steps }
    }

    /// Continues from `record`'s step.
    pub fn load_record(mut self, record: BlockCoordinateRecord) -> Self {
        self.steps = record.steps;
        self
    }
}

/// Spreads the pass numbers over the seeds of [`BlockOrder::Random`]'s permutations (the
/// golden ratio's 64-bit fraction, as SplitMix64 steps its state).
const PASS_MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// Sets `require_grad` on each trainable parameter: on in the active block and `always`, off
/// elsewhere; with a `weights_home`, places each one there, or in host memory when it is
/// neither training nor pinned. Paths are joined with `.`, as `ModuleOptimizer` matches its
/// groups.
struct Freeze<'a> {
    active: &'a ParamGroup,
    always: Option<&'a ParamGroup>,
    pinned: Option<&'a ParamGroup>,
    weights_home: Option<&'a Device>,
    /// The paths of the parameters that train at all (see [`BlockCoordinate`]'s field), filled
    /// on the `first_call`.
    trainable: &'a mut HashSet<String>,
    first_call: bool,
    /// Whether `require_grad` is set, or only the weights placed.
    freeze: bool,
    path: Vec<String>,
    /// The device of the first training parameter mapped.
    device: Option<Device>,
}

impl ModuleMapper for Freeze<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.into());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let path = self.path.join(".");
        if self.first_call && param.val().is_require_grad() {
            self.trainable.insert(path.clone());
        }
        if !self.trainable.contains(&path) {
            return param;
        }
        let in_group = |group: Option<&ParamGroup>| {
            group.is_some_and(|group| group.matches(&param.id, Some(&path)))
        };
        let trains = in_group(Some(self.active)) || in_group(self.always);
        let param = match self.weights_home {
            Some(home) if trains || in_group(self.pinned) => place(param, home),
            Some(_) => place(param, &Device::flex()),
            None => param,
        };
        if trains && self.device.is_none() {
            self.device = Some(param.val().device());
        }
        if !self.freeze || param.val().is_require_grad() == trains {
            return param;
        }
        param.set_require_grad(trains)
    }
}

/// Brings every float parameter to a device, for [`BlockCoordinate::end`].
struct Home<'a>(&'a Device);

impl ModuleMapper for Home<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        place(param, self.0)
    }
}

/// `param` on `device` (in host memory for Flex), its value moved when it is elsewhere (see
/// [`crate::host`]), keeping its autodiff association and `require_grad`.
fn place<const D: usize>(param: Param<Tensor<D>>, device: &Device) -> Param<Tensor<D>> {
    let value = param.val();
    let here = value.device();
    if same_memory(&here, device) {
        return param;
    }
    let (id, value, mapper) = param.consume();
    let require_grad = value.is_require_grad();
    // Autodiff as before (`Tensor::to_device` keeps the source's context, not the target's).
    let target = device.clone().with_autodiff_context_from(&here);
    let moved = match *device == Device::flex() {
        true => Tensor::from_data(read_back(value), &target),
        false => upload(&value, &target),
    };
    let moved = match require_grad {
        true => moved.require_grad(),
        false => moved,
    };
    Param::from_mapped_value(id, moved, mapper)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(order: BlockOrder, blocks: usize, switch_every: usize) -> BlockCoordinate {
        BlockCoordinateConfig::new((0..blocks).map(|_| ParamGroup::all()).collect())
            .with_switch_every(switch_every)
            .with_order(order)
            .init()
            .unwrap()
    }

    fn blocks_over(schedule: &BlockCoordinate, steps: u64) -> Vec<usize> {
        (0..steps).map(|step| schedule.block_at(step)).collect()
    }

    #[test]
    fn orders_visit_each_block_for_switch_every_steps() {
        let ascending = schedule(BlockOrder::Ascending, 3, 2);
        assert_eq!(
            blocks_over(&ascending, 8),
            [0, 0, 1, 1, 2, 2, 0, 0],
            "ascending"
        );
        let descending = schedule(BlockOrder::Descending, 3, 2);
        assert_eq!(
            blocks_over(&descending, 8),
            [2, 2, 1, 1, 0, 0, 2, 2],
            "descending"
        );
    }

    #[test]
    fn a_random_order_is_a_new_permutation_each_pass_and_a_function_of_the_step() {
        let random = schedule(BlockOrder::Random { seed: 7 }, 6, 1);
        let passes: Vec<Vec<usize>> = (0..8)
            .map(|pass| blocks_over(&random, 6 * (pass + 1))[6 * pass as usize..].to_vec())
            .collect();
        for pass in &passes {
            let mut sorted = pass.clone();
            sorted.sort_unstable();
            assert_eq!(
                sorted,
                (0..6).collect::<Vec<_>>(),
                "each pass visits every block once"
            );
        }
        let distinct: HashSet<&Vec<usize>> = passes.iter().collect();
        assert!(distinct.len() > 4, "passes draw new orders: {passes:?}");
        let again = schedule(BlockOrder::Random { seed: 7 }, 6, 1);
        assert_eq!(blocks_over(&again, 48), blocks_over(&random, 48));
        let other_seed = schedule(BlockOrder::Random { seed: 8 }, 6, 1);
        assert_ne!(blocks_over(&other_seed, 48), blocks_over(&random, 48));
    }

    #[test]
    fn a_config_without_blocks_or_steps_is_refused() {
        let none = BlockCoordinateConfig::new(Vec::new()).init();
        assert_eq!(none.unwrap_err(), BlockCoordinateError::NoBlocks);
        let zero = BlockCoordinateConfig::new(vec![ParamGroup::all()])
            .with_switch_every(0)
            .init();
        assert_eq!(zero.unwrap_err(), BlockCoordinateError::ZeroSwitchEvery);
    }
}
