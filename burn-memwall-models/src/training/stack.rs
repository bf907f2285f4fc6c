//! The named stacks: each a set of the model's and the optimizer's switches, so that one flag
//! turns the whole of burn-memwall on (or off) for `train` and `memgate`.

use burn_memwall::memory::budget::OptimizerPlan;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::optim::{HalfPrecisionUpdate, HostOffload, MomentBits};

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
    /// `memwall` with plain SGD during backward: no optimizer state at all.
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
                optimizer: StepOptimizer::InBackwardSgd,
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
