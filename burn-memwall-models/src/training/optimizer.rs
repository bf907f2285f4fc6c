//! Which optimizer trains the model, and whether it steps during backward.

use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn_memwall::memory::budget::{OptimizerPlan, UpdateTiming};
use burn_memwall::optim::{FusedAdamWConfig, FusedSgdConfig, InBackward};
use serde::{Deserialize, Serialize};

/// Which optimizer updates the model, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepOptimizer {
    /// Burn's AdamW after backward: the baseline.
    AdamW,
    /// AdamW applied during backward by [`InBackward`].
    InBackwardAdamW,
    /// burn-memwall's in-place [`FusedAdamW`](burn_memwall::optim::FusedAdamW) applied during
    /// backward.
    InBackwardFusedAdamW,
    /// Plain SGD (no state) applied during backward by [`InBackward`].
    InBackwardSgd,
    /// burn-memwall's in-place [`FusedSgd`](burn_memwall::optim::FusedSgd) (momentum 0.9,
    /// dampening 0.1) applied during backward.
    InBackwardFusedSgd,
}

impl StepOptimizer {
    /// The optimizer, with AdamW's decoupled `weight_decay` (SGD takes none).
    pub fn init(self, weight_decay: f32) -> ModuleOptimizer {
        match self {
            Self::AdamW | Self::InBackwardAdamW => {
                AdamWConfig::new().with_weight_decay(weight_decay).init()
            }
            Self::InBackwardFusedAdamW => FusedAdamWConfig::new()
                .with_weight_decay(weight_decay)
                .init(),
            Self::InBackwardSgd => SgdConfig::new().init(),
            Self::InBackwardFusedSgd => FusedSgdConfig::new().init(),
        }
    }

    /// What the optimizer holds, for the memory budget. Burn's AdamW on Flex allocates one
    /// parameter-sized temporary per update (element-wise ops run in place on unique tensors,
    /// docs/memory-model/peak-phases.md, M9); its SGD without momentum and the fused updates
    /// need no temporary. Only the fused updates write into the parameter's own buffer.
    pub fn plan(self) -> OptimizerPlan {
        let (moments, update_temporaries) = match self {
            Self::AdamW | Self::InBackwardAdamW => (2, 1),
            Self::InBackwardFusedAdamW => (2, 0),
            Self::InBackwardSgd => (0, 0),
            Self::InBackwardFusedSgd => (1, 0),
        };
        let timing = match self {
            Self::AdamW => UpdateTiming::AfterBackward,
            _ => UpdateTiming::InBackward,
        };
        OptimizerPlan {
            moments,
            timing,
            update_temporaries,
            in_place: matches!(self, Self::InBackwardFusedAdamW | Self::InBackwardFusedSgd),
        }
    }

    /// The handle that routes the model's parameters, for the optimizers that step in backward.
    pub fn in_backward(self) -> Option<InBackward> {
        (self != Self::AdamW).then(InBackward::new)
    }
}
