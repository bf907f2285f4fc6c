//! The named stacks: each a set of the model's and the optimizer's switches, so that one flag
//! turns the whole of burn-memwall on (or off) for `train` and `memgate`.

use burn_memwall::memory::budget::OptimizerPlan;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::optim::{
    BlockOrder, HalfPrecisionUpdate, HostOffload, InactiveState, MomentBits,
};

use crate::Error;
use crate::lm::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind, SaverKind};

use super::{BlockSchedule, StepOptimizer};

/// A named set of [`Switches`]: see [`Stack::switches`] for what each one sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    /// Burn's own path: Burn's attention, full logits + `CrossEntropyLoss`, standard blocks,
    /// dense linears, Burn's AdamW after backward.
    Baseline,
    /// Every exact part: flash attention, the fused loss, full-width reversible blocks, the
    /// saving norm and MLP ops, dense linears and the in-place `FusedAdamW` applied during
    /// backward. The same parameters as
    /// the baseline, trained by the same optimizer's math.
    Memwall,
    /// `memwall` with plain SGD during backward, written in place (`FusedSgd` without
    /// momentum): no optimizer state at all.
    MemwallSgd,
    /// `memwall` with every matrix a 6-bit counter code (the blocks' linears, the embedding and
    /// the head: their optimizer lives in the weight code); the norms stay dense and train with
    /// `FusedAdamW`.
    MemwallCounter,
    /// `memwall` with AdamW's moments in 8 bits (`LowBitAdamW`): 2 bytes of optimizer state
    /// per parameter instead of 8.
    MemwallAdam8,
    /// `memwall` with AdamW's moments in 4 bits: 1 byte per parameter.
    MemwallAdam4,
    /// `memwall` training one block at a time (BAdam's schedule: 50 steps per block, from the
    /// head down): optimizer state for the largest block only.
    MemwallBadam,
    /// `memwall` with the optimizer's state in host memory between updates (`HostOffloaded`):
    /// on the device, the state of the parameter being updated only. Devices with memory of
    /// their own only (refused on Flex).
    MemwallOffload,
    /// `memwall` with its update run on the host (`HostStepped`): the state and an f32 master
    /// of each weight in host memory, no state on the device; each update reads a gradient
    /// back and writes a weight. Devices with memory of their own only (refused on Flex).
    MemwallHostUpdate,
}

impl Stack {
    /// Every stack, baseline first.
    pub const ALL: [Self; 9] = [
        Self::Baseline,
        Self::Memwall,
        Self::MemwallSgd,
        Self::MemwallCounter,
        Self::MemwallAdam8,
        Self::MemwallAdam4,
        Self::MemwallBadam,
        Self::MemwallOffload,
        Self::MemwallHostUpdate,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Memwall => "memwall",
            Self::MemwallSgd => "memwall-sgd",
            Self::MemwallCounter => "memwall-counter",
            Self::MemwallAdam8 => "memwall-adam8",
            Self::MemwallAdam4 => "memwall-adam4",
            Self::MemwallBadam => "memwall-badam",
            Self::MemwallOffload => "memwall-offload",
            Self::MemwallHostUpdate => "memwall-host-update",
        }
    }

    /// The stack called `name`.
    pub fn from_name(name: &str) -> Result<Self, Error> {
        Self::ALL
            .into_iter()
            .find(|stack| stack.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
                Error::InvalidConfig(format!(
                    "unknown stack `{name}`; expected one of {}",
                    names.join(", ")
                ))
            })
    }

    /// What this stack turns on.
    pub const fn switches(self) -> Switches {
        const BASELINE: Switches = Switches {
            attention: AttentionKind::Burn,
            loss: LossKind::Burn,
            blocks: BlockKind::Standard,
            linear: LinearKind::Dense,
            savers: SaverKind::Burn,
            saved_precision: SavedPrecision::Full,
            optimizer: StepOptimizer::AdamW,
            block_coordinate: None,
            host_offload: None,
        };
        const MEMWALL: Switches = Switches {
            attention: AttentionKind::Flash,
            loss: LossKind::Fused,
            blocks: BlockKind::Reversible,
            linear: LinearKind::Dense,
            savers: SaverKind::Exact,
            saved_precision: SavedPrecision::Full,
            optimizer: StepOptimizer::InBackwardFusedAdamW,
            block_coordinate: None,
            host_offload: None,
        };
        match self {
            Self::Baseline => BASELINE,
            Self::Memwall => MEMWALL,
            Self::MemwallSgd => Switches {
                optimizer: StepOptimizer::InBackwardFusedPlainSgd,
                ..MEMWALL
            },
            Self::MemwallCounter => Switches {
                linear: LinearKind::CounterAll,
                ..MEMWALL
            },
            Self::MemwallAdam8 => Switches {
                optimizer: StepOptimizer::InBackwardLowBitAdamW(MomentBits::Eight),
                ..MEMWALL
            },
            Self::MemwallAdam4 => Switches {
                optimizer: StepOptimizer::InBackwardLowBitAdamW(MomentBits::Four),
                ..MEMWALL
            },
            Self::MemwallBadam => Switches {
                block_coordinate: Some(BlockSchedule::BADAM),
                ..MEMWALL
            },
            Self::MemwallOffload => Switches {
                host_offload: Some(HostOffload::State),
                ..MEMWALL
            },
            Self::MemwallHostUpdate => Switches {
                host_offload: Some(HostOffload::Update),
                ..MEMWALL
            },
        }
    }

    /// Sets this stack's switches in `model` and returns its optimizer.
    pub fn apply(self, model: &mut LmConfig) -> StepOptimizer {
        self.switches().apply(model)
    }
}

/// One choice for each part of the training path: what a stack is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switches {
    pub attention: AttentionKind,
    pub loss: LossKind,
    pub blocks: BlockKind,
    /// The model's matrices (see [`LinearKind`]); the norms stay dense.
    pub linear: LinearKind,
    pub savers: SaverKind,
    /// How the saving SwiGLU keeps its inputs (with `savers` = `Exact`).
    pub saved_precision: SavedPrecision,
    pub optimizer: StepOptimizer,
    /// Whether the model trains one block at a time, and how.
    pub block_coordinate: Option<BlockSchedule>,
    /// What of the optimizer stays in host memory, if anything.
    pub host_offload: Option<HostOffload>,
}

impl Switches {
    /// What the budget sees of the optimizer, with weights updated as `half_precision` says.
    pub fn optimizer_plan(self, half_precision: Option<HalfPrecisionUpdate>) -> OptimizerPlan {
        OptimizerPlan {
            one_block_at_a_time: self
                .block_coordinate
                .map(|schedule| schedule.inactive_state),
            inactive_weights_on_host: self
                .block_coordinate
                .is_some_and(|schedule| schedule.weights_on_host),
            host_offload: self.host_offload,
            ..self.optimizer.plan(half_precision)
        }
    }

    /// Sets the model's switches in `model` and returns the optimizer.
    pub fn apply(self, model: &mut LmConfig) -> StepOptimizer {
        model.attention = self.attention;
        model.loss = self.loss;
        model.blocks = self.blocks;
        model.linear = self.linear;
        model.savers = self.savers;
        model.saved_precision = self.saved_precision;
        self.optimizer
    }
}

/// Parts chosen beside a stack (`train`'s flags): each one given replaces the stack's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub attention: Option<AttentionKind>,
    pub loss: Option<LossKind>,
    pub blocks: Option<BlockKind>,
    pub linear: Option<LinearKind>,
    /// What the norms and the MLP's activation keep for backward, and in which precision.
    pub savers: Option<(SaverKind, SavedPrecision)>,
    pub host_offload: Option<HostOffload>,
    pub schedule: ScheduleOverrides,
}

/// Settings of block-coordinate training chosen beside a stack; each one given replaces the
/// stack's schedule's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScheduleOverrides {
    pub switch_every: Option<usize>,
    pub order: Option<BlockOrder>,
    /// Keep each block's optimizer state for its next turn ([`InactiveState::Kept`]).
    pub keep_state: bool,
    pub weights_on_host: bool,
}

impl ScheduleOverrides {
    /// `schedule` with these settings; if there is none and any setting is given, BAdam's
    /// with them: a schedule setting alone asks for block-coordinate training.
    pub fn turn_on(self, schedule: Option<BlockSchedule>) -> Option<BlockSchedule> {
        match self == Self::default() {
            true => schedule,
            false => self.set(Some(schedule.unwrap_or(BlockSchedule::BADAM))),
        }
    }

    /// `schedule`, if there is one, with these settings; none is turned on.
    pub fn set(self, schedule: Option<BlockSchedule>) -> Option<BlockSchedule> {
        schedule.map(|schedule| BlockSchedule {
            switch_every: self.switch_every.unwrap_or(schedule.switch_every),
            order: self.order.unwrap_or(schedule.order),
            inactive_state: match self.keep_state {
                true => InactiveState::Kept,
                false => schedule.inactive_state,
            },
            weights_on_host: self.weights_on_host || schedule.weights_on_host,
        })
    }
}

impl Switches {
    /// These switches with each part that `overrides` gives in place of theirs; its schedule
    /// settings [turn block-coordinate training on](ScheduleOverrides::turn_on).
    pub fn with_overrides(self, overrides: Overrides) -> Self {
        let (savers, saved_precision) = overrides
            .savers
            .unwrap_or((self.savers, self.saved_precision));
        Self {
            attention: overrides.attention.unwrap_or(self.attention),
            loss: overrides.loss.unwrap_or(self.loss),
            blocks: overrides.blocks.unwrap_or(self.blocks),
            linear: overrides.linear.unwrap_or(self.linear),
            savers,
            saved_precision,
            optimizer: self.optimizer,
            block_coordinate: overrides.schedule.turn_on(self.block_coordinate),
            host_offload: overrides.host_offload.or(self.host_offload),
        }
    }
}

/// A stack by name: one of the named [`Stack`]s or of the [`PARTS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamedSwitches {
    pub name: &'static str,
    pub switches: Switches,
}

impl NamedSwitches {
    /// This stack with [`BlockSchedule::weights_on_host`] set to `weights_on_host` when it
    /// trains one block at a time; any other stack as it is.
    pub fn with_weights_on_host(mut self, weights_on_host: bool) -> Self {
        if let Some(schedule) = &mut self.switches.block_coordinate {
            schedule.weights_on_host = weights_on_host;
        }
        self
    }
}

const BASELINE: Switches = Stack::Baseline.switches();
const FLASH_FUSED: Switches = Switches {
    attention: AttentionKind::Flash,
    loss: LossKind::Fused,
    ..BASELINE
};

const SAVERS: Switches = Switches {
    savers: SaverKind::Exact,
    ..FLASH_FUSED
};

const fn part(name: &'static str, switches: Switches) -> NamedSwitches {
    NamedSwitches { name, switches }
}

/// Single parts and their combinations, each measured on its own by memgate after the named
/// stacks. The
/// reversible rows have the baseline's parameters in another architecture; the linear rows
/// change the blocks' linears only (embeddings, norms and head stay dense).
pub const PARTS: [NamedSwitches; 17] = [
    part(
        "flash-attention",
        Switches {
            attention: AttentionKind::Flash,
            ..BASELINE
        },
    ),
    part(
        "fused-loss",
        Switches {
            loss: LossKind::Fused,
            ..BASELINE
        },
    ),
    part("flash+fused", FLASH_FUSED),
    part("flash+fused+savers", SAVERS),
    part(
        "flash+fused+savers-int8",
        Switches {
            saved_precision: SavedPrecision::Int8,
            ..SAVERS
        },
    ),
    part(
        "flash+fused+savers-int4",
        Switches {
            saved_precision: SavedPrecision::Int4,
            ..SAVERS
        },
    ),
    part(
        "in-backward",
        Switches {
            optimizer: StepOptimizer::InBackwardAdamW,
            ..BASELINE
        },
    ),
    part(
        "in-backward-fused-adamw",
        Switches {
            optimizer: StepOptimizer::InBackwardFusedAdamW,
            ..BASELINE
        },
    ),
    part(
        "in-backward-sgd",
        Switches {
            optimizer: StepOptimizer::InBackwardSgd,
            ..BASELINE
        },
    ),
    part(
        "in-backward-fused-sgd",
        Switches {
            optimizer: StepOptimizer::InBackwardFusedSgd,
            ..BASELINE
        },
    ),
    part(
        "flash+fused+in-backward",
        Switches {
            optimizer: StepOptimizer::InBackwardAdamW,
            ..FLASH_FUSED
        },
    ),
    part(
        "all-fused",
        Switches {
            optimizer: StepOptimizer::InBackwardFusedAdamW,
            ..FLASH_FUSED
        },
    ),
    part(
        "reversible",
        Switches {
            blocks: BlockKind::Reversible,
            ..BASELINE
        },
    ),
    part(
        "reversible+flash+fused",
        Switches {
            blocks: BlockKind::Reversible,
            ..FLASH_FUSED
        },
    ),
    part(
        "ternary",
        Switches {
            linear: LinearKind::Ternary,
            ..BASELINE
        },
    ),
    part(
        "counter",
        Switches {
            linear: LinearKind::Counter,
            ..BASELINE
        },
    ),
    part(
        "counter+all-fused",
        Switches {
            linear: LinearKind::Counter,
            optimizer: StepOptimizer::InBackwardFusedAdamW,
            ..FLASH_FUSED
        },
    ),
];

/// Every stack, the named ones first, then the [`PARTS`]: the rows memgate measures.
pub fn every_stack() -> Vec<NamedSwitches> {
    Stack::ALL
        .into_iter()
        .map(|named| part(named.name(), named.switches()))
        .chain(PARTS)
        .collect()
}

/// The stack of [`every_stack`] called `name`.
pub fn find_stack(name: &str) -> Result<NamedSwitches, Error> {
    let stacks = every_stack();
    stacks
        .iter()
        .find(|stack| stack.name == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = stacks.iter().map(|stack| stack.name).collect();
            Error::InvalidConfig(format!(
                "unknown stack `{name}`; expected one of {}",
                names.join(", ")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_override_changes_no_stack() {
        for stack in every_stack() {
            let switches = stack.switches;
            assert_eq!(
                switches.with_overrides(Overrides::default()),
                switches,
                "{}",
                stack.name
            );
        }
    }

    #[test]
    fn a_part_override_replaces_that_part_only() {
        let memwall = Stack::Memwall.switches();
        let overridden = memwall.with_overrides(Overrides {
            attention: Some(AttentionKind::Burn),
            savers: Some((SaverKind::Exact, SavedPrecision::Int4)),
            host_offload: Some(HostOffload::Update),
            ..Overrides::default()
        });
        assert_eq!(
            overridden,
            Switches {
                attention: AttentionKind::Burn,
                saved_precision: SavedPrecision::Int4,
                host_offload: Some(HostOffload::Update),
                ..memwall
            }
        );
        assert_ne!(memwall.attention, AttentionKind::Burn);
        assert_ne!(memwall.saved_precision, SavedPrecision::Int4);
    }

    #[test]
    fn a_schedule_setting_turns_block_coordinate_training_on() {
        let memwall = Stack::Memwall.switches();
        assert_eq!(memwall.block_coordinate, None);
        let every_three = ScheduleOverrides {
            switch_every: Some(3),
            ..ScheduleOverrides::default()
        };
        let schedule = memwall
            .with_overrides(Overrides {
                schedule: every_three,
                ..Overrides::default()
            })
            .block_coordinate;
        assert_eq!(
            schedule,
            Some(BlockSchedule {
                switch_every: 3,
                ..BlockSchedule::BADAM
            })
        );
        let on_host = ScheduleOverrides {
            weights_on_host: true,
            ..ScheduleOverrides::default()
        };
        assert_eq!(
            on_host.turn_on(None),
            Some(BlockSchedule {
                weights_on_host: true,
                ..BlockSchedule::BADAM
            })
        );
    }

    #[test]
    fn setting_a_schedule_keeps_what_is_not_given_and_turns_none_on() {
        let badam = Stack::MemwallBadam.switches().block_coordinate;
        let own = BlockSchedule {
            switch_every: 7,
            order: BlockOrder::Ascending,
            inactive_state: InactiveState::Dropped,
            weights_on_host: false,
        };
        assert_ne!(badam, Some(own));
        let random_kept = ScheduleOverrides {
            order: Some(BlockOrder::Random { seed: 5 }),
            keep_state: true,
            ..ScheduleOverrides::default()
        };
        assert_eq!(
            random_kept.set(Some(own)),
            Some(BlockSchedule {
                order: BlockOrder::Random { seed: 5 },
                inactive_state: InactiveState::Kept,
                ..own
            })
        );
        assert_eq!(random_kept.set(None), None);
        assert_eq!(random_kept.turn_on(Some(own)), random_kept.set(Some(own)));
    }
}
