//! The named stacks: each a set of the model's and the optimizer's switches, so that one flag
//! turns the whole of burn-memwall on (or off) for `train` and `memgate`.

use crate::Error;
use crate::lm::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind};

use super::StepOptimizer;

/// A named set of switches. See [`Stack::apply`] for what each one sets.
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
    /// `memwall` with 6-bit counter linears in the blocks (their optimizer lives in the weight
    /// code); embeddings, norms and head stay dense and train with `FusedAdamW`.
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

    /// Sets the model's switches of this stack in `model` and returns its optimizer.
    pub fn apply(self, model: &mut LmConfig) -> StepOptimizer {
        let memwall = self != Self::Baseline;
        (model.attention, model.loss, model.blocks) = if memwall {
            (AttentionKind::Flash, LossKind::Fused, BlockKind::Reversible)
        } else {
            (AttentionKind::Burn, LossKind::Burn, BlockKind::Standard)
        };
        model.linear = match self {
            Self::MemwallCounter => LinearKind::Counter,
            _ => LinearKind::Dense,
        };
        match self {
            Self::Baseline => StepOptimizer::AdamW,
            Self::Memwall | Self::MemwallCounter => StepOptimizer::InBackwardFusedAdamW,
            Self::MemwallSgd => StepOptimizer::InBackwardSgd,
        }
    }
}
