//! Which optimizer trains the model, and whether it steps during backward.

use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
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

    /// The handle that routes the model's parameters, for the optimizers that step in backward.
    pub fn in_backward(self) -> Option<InBackward> {
        (self != Self::AdamW).then(InBackward::new)
    }
}
