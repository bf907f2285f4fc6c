//! The named stacks: each a set of the model's and the optimizer's switches, so that one flag
//! turns the whole of burn-memwall on (or off) for `train` and `memgate`.

use crate::Error;
use crate::lm::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind};

use super::StepOptimizer;

/// A named set of [`Switches`]: see [`Stack::switches`] for what each one sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    /// Burn's own path: Burn's attention, full logits + `CrossEntropyLoss`, standard blocks,
    /// dense linears, Burn's AdamW after backward.
    Baseline,
    /// Every exact part: flash attention, the fused loss, full-width reversible blocks, dense
    /// linears and the in-place `FusedAdamW` applied during backward. The same parameters as
    /// the baseline, trained by the same optimizer's math.
    Memwall,
    /// `memwall` with plain SGD during backward: no optimizer state at all.
    MemwallSgd,
    /// `memwall` with every matrix a 6-bit counter code (the blocks' linears, the embedding and
    /// the head: their optimizer lives in the weight code); the norms stay dense and train with
    /// `FusedAdamW`.
    MemwallCounter,
}

impl Stack {
    /// Every stack, baseline first.
    pub const ALL: [Self; 4] = [
        Self::Baseline,
        Self::Memwall,
        Self::MemwallSgd,
        Self::MemwallCounter,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Memwall => "memwall",
            Self::MemwallSgd => "memwall-sgd",
            Self::MemwallCounter => "memwall-counter",
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
            optimizer: StepOptimizer::AdamW,
        };
        const MEMWALL: Switches = Switches {
            attention: AttentionKind::Flash,
            loss: LossKind::Fused,
            blocks: BlockKind::Reversible,
            linear: LinearKind::Dense,
            optimizer: StepOptimizer::InBackwardFusedAdamW,
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
    pub optimizer: StepOptimizer,
}

impl Switches {
    /// Sets the model's switches in `model` and returns the optimizer.
    pub fn apply(self, model: &mut LmConfig) -> StepOptimizer {
        model.attention = self.attention;
        model.loss = self.loss;
        model.blocks = self.blocks;
        model.linear = self.linear;
        self.optimizer
    }
}
