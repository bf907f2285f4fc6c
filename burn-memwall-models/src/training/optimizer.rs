//! Which optimizer trains the model, and whether it steps during backward.

use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::prelude::Device;
use burn::tensor::FloatDType;
use burn_memwall::memory::budget::{Moments, OptimizerPlan, UpdateTiming};
use burn_memwall::optim::{
    BlockCoordinate, BlockCoordinateConfig, BlockOrder, FusedAdamWConfig, FusedSgdConfig,
    HalfPrecisionUpdate, HostOffload, HostOffloadError, HostOffloaded, HostStepped, InBackward,
    InactiveState, LossScale, LossScaled, LowBitAdamWConfig, MasterWeights, MomentBits,
    StochasticRounding,
};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::lm::LmConfig;

/// The float type the model is stored and computed in (the device's default float type), and
/// for bf16 and f16 how the weights take their updates. The optimizer steps in f32 in every
/// case, its state in f32. f16 trains with a dynamic loss scale
/// ([`TrainingConfig::loss_scale`](super::TrainingConfig::loss_scale)): its range would flush
/// the gradients to zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    F32,
    Bf16(HalfPrecisionUpdate),
    F16(HalfPrecisionUpdate),
}

impl Precision {
    /// The names on the command line: `f32`, `bf16` or `f16`, and for half precision
    /// `masters` or `stochastic-rounding`.
    ///
    /// # Errors
    /// Another name, naming the ones there are.
    pub fn from_names(float: &str, update: &str) -> Result<Self, Error> {
        let update = match update {
            "masters" => HalfPrecisionUpdate::Masters,
            "stochastic-rounding" => HalfPrecisionUpdate::StochasticRounding,
            other => {
                return Err(Error::InvalidConfig(format!(
                    "unknown update of half-precision weights `{other}`; expected masters or \
                     stochastic-rounding"
                )));
            }
        };
        match float {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16(update)),
            "f16" => Ok(Self::F16(update)),
            other => Err(Error::InvalidConfig(format!(
                "unknown precision `{other}`; expected f32, bf16 or f16"
            ))),
        }
    }

    /// The float type.
    pub fn dtype(self) -> FloatDType {
        match self {
            Self::F32 => FloatDType::F32,
            Self::Bf16(_) => FloatDType::BF16,
            Self::F16(_) => FloatDType::F16,
        }
    }

    /// Whether training in this precision scales its loss: f16 does, f32 and bf16 have f32's
    /// range.
    pub fn scales_loss(self) -> bool {
        matches!(self, Self::F16(_))
    }

    /// How half-precision weights take their updates; `None` in f32.
    pub fn half_update(self) -> Option<HalfPrecisionUpdate> {
        match self {
            Self::F32 => None,
            Self::Bf16(update) | Self::F16(update) => Some(update),
        }
    }
}

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
    /// [`FusedSgd`](burn_memwall::optim::FusedSgd) without momentum, applied during backward:
    /// `InBackwardSgd`'s math and no state, each parameter written in its own buffer.
    InBackwardFusedPlainSgd,
    /// burn-memwall's [`LowBitAdamW`](burn_memwall::optim::LowBitAdamW), both moments in 8 or
    /// 4 bits, applied during backward.
    InBackwardLowBitAdamW(MomentBits),
}

impl StepOptimizer {
    /// The optimizer, with AdamW's decoupled `weight_decay` (SGD takes none), for weights in
    /// `precision` (stochastic roundings drawn under `seed`), given gradients of losses scaled by
    /// `loss_scale` if one is given, with what `offload` says in host memory for parameters on
    /// the device it names.
    ///
    /// # Errors
    /// An offload from a device that computes in host memory (Flex); the update on the host
    /// for weights rounded stochastically (it keeps f32 masters).
    pub fn init(
        self,
        weight_decay: f32,
        precision: Precision,
        seed: u64,
        loss_scale: Option<&LossScale>,
        offload: Option<(HostOffload, &Device)>,
    ) -> Result<ModuleOptimizer, Error> {
        let decorations = Decorations {
            precision,
            seed,
            loss_scale,
            offload,
        };
        match self {
            Self::AdamW | Self::InBackwardAdamW => {
                decorations.apply(AdamWConfig::new().with_weight_decay(weight_decay).build())
            }
            Self::InBackwardFusedAdamW => decorations.apply(
                FusedAdamWConfig::new()
                    .with_weight_decay(weight_decay)
                    .build(),
            ),
            Self::InBackwardLowBitAdamW(bits) => decorations.apply(
                LowBitAdamWConfig::new(bits)
                    .with_adamw(FusedAdamWConfig::new().with_weight_decay(weight_decay))
                    .build(),
            ),
            Self::InBackwardSgd => decorations.apply(SgdConfig::new().build()),
            Self::InBackwardFusedSgd => decorations.apply(
                FusedSgdConfig::new()
                    .with_momentum(Some(MomentumConfig::new()))
                    .build(),
            ),
            Self::InBackwardFusedPlainSgd => decorations.apply(FusedSgdConfig::new().build()),
        }
    }

    /// What the optimizer holds, for the memory budget. Burn's AdamW on Flex allocates one
    /// parameter-sized temporary per update (element-wise ops run in place on unique tensors,
    /// docs/memory-model/peak-phases.md, M9); its SGD without momentum and the fused updates
    /// need no temporary (the low-bit update's two code tables are 2 KiB). Only the fused
    /// updates write into the parameter's own buffer.
    /// Half-precision weights run the update in f32 on copies ([`Precision::half_update`]).
    pub fn plan(self, half_precision: Option<HalfPrecisionUpdate>) -> OptimizerPlan {
        let (moments, update_temporaries) = match self {
            Self::AdamW | Self::InBackwardAdamW => (Moments::F32(2), 1),
            Self::InBackwardFusedAdamW => (Moments::F32(2), 0),
            Self::InBackwardLowBitAdamW(bits) => (Moments::Coded(bits), 0),
            Self::InBackwardSgd | Self::InBackwardFusedPlainSgd => (Moments::F32(0), 0),
            Self::InBackwardFusedSgd => (Moments::F32(1), 0),
        };
        let timing = match self {
            Self::AdamW => UpdateTiming::AfterBackward,
            _ => UpdateTiming::InBackward,
        };
        OptimizerPlan {
            moments,
            timing,
            update_temporaries,
            in_place: matches!(
                self,
                Self::InBackwardFusedAdamW
                    | Self::InBackwardLowBitAdamW(_)
                    | Self::InBackwardFusedSgd
                    | Self::InBackwardFusedPlainSgd
            ),
            half_precision,
            one_block_at_a_time: None,
            inactive_weights_on_host: false,
            host_offload: None,
        }
    }

    /// The handle that routes the model's parameters, for the optimizers that step in backward.
    pub fn in_backward(self) -> Option<InBackward> {
        (self != Self::AdamW).then(InBackward::new)
    }
}

/// Block-coordinate training of the reference model (BAdam): its
/// [`LmConfig::coordinate_blocks`] (the token table, each layer, the head) one at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSchedule {
    /// Steps each block trains before the next.
    pub switch_every: usize,
    /// The order of the blocks in each pass.
    pub order: BlockOrder,
    /// What happens to a block's optimizer state when its turn ends (runs recorded before
    /// this setting existed dropped it).
    #[serde(default)]
    pub inactive_state: InactiveState,
    /// Whether the weights of the blocks not training wait in host memory (a token table tied
    /// to the head stays on the device); runs recorded before this setting existed kept them
    /// on the device.
    #[serde(default)]
    pub weights_on_host: bool,
}

impl BlockSchedule {
    /// BAdam's defaults: 50 steps per block, from the head down.
    pub const BADAM: Self = Self {
        switch_every: 50,
        order: BlockOrder::Descending,
        inactive_state: InactiveState::Dropped,
        weights_on_host: false,
    };

    /// The schedule over `model`'s blocks, at its first step, for a model on `device`.
    ///
    /// # Errors
    /// `switch_every` = 0, or the weights on the host of a device that computes in host
    /// memory.
    pub fn init(self, model: &LmConfig, device: &Device) -> Result<BlockCoordinate, Error> {
        let schedule = BlockCoordinateConfig::new(model.coordinate_blocks())
            .with_switch_every(self.switch_every)
            .with_order(self.order)
            .with_inactive_state(self.inactive_state)
            // Only the weights on the host have anything to pin: the group's compiled pattern
            // would count in every other run's memory (22 KB on `tiny`).
            .with_pinned(match self.weights_on_host {
                true => model.coordinate_pinned(),
                false => None,
            })
            .init()
            .map_err(|error| Error::InvalidConfig(error.to_string()))?;
        match self.weights_on_host {
            true => schedule
                .with_inactive_weights_on_host(device)
                .map_err(refused),
            false => Ok(schedule),
        }
    }
}

/// What an optimizer is wrapped in for the weights' precision, the state's place and the
/// loss's scale.
struct Decorations<'a> {
    precision: Precision,
    /// Seeds stochastic roundings.
    seed: u64,
    loss_scale: Option<&'a LossScale>,
    /// What lives in host memory, and the parameters' device.
    offload: Option<(HostOffload, &'a Device)>,
}

impl Decorations<'_> {
    /// `optimizer` as it is in f32, decorated for half precision, its state (with the masters)
    /// offloaded, and unscaling the gradients of scaled losses first. The update on the host
    /// keeps f32 masters of its own, whatever the weights' precision.
    fn apply<O: Optimizer>(&self, optimizer: O) -> Result<ModuleOptimizer, Error> {
        match (self.offload, self.precision.half_update()) {
            (Some((HostOffload::Update, device)), None | Some(HalfPrecisionUpdate::Masters)) => {
                Ok(self.unscaled(HostStepped::new(optimizer, device).map_err(refused)?))
            }
            (Some((HostOffload::Update, _)), Some(HalfPrecisionUpdate::StochasticRounding)) => {
                Err(Error::InvalidConfig(
                    "the update on the host keeps an f32 master of each weight, so there is \
                     nothing to round stochastically: use the masters update of half-precision \
                     weights with it"
                        .into(),
                ))
            }
            (_, None) => self.placed(optimizer),
            (_, Some(HalfPrecisionUpdate::Masters)) => self.placed(MasterWeights::new(optimizer)),
            (_, Some(HalfPrecisionUpdate::StochasticRounding)) => {
                self.placed(StochasticRounding::new(optimizer, self.seed as u32))
            }
        }
    }

    /// `optimizer` with its state in host memory between updates if the offload says so.
    fn placed<O: Optimizer>(&self, optimizer: O) -> Result<ModuleOptimizer, Error> {
        Ok(match self.offload {
            Some((_, device)) => {
                self.unscaled(HostOffloaded::new(optimizer, device).map_err(refused)?)
            }
            None => self.unscaled(optimizer),
        })
    }

    fn unscaled<O: Optimizer>(&self, optimizer: O) -> ModuleOptimizer {
        match self.loss_scale {
            Some(scale) => LossScaled::new(optimizer, scale.clone()).into(),
            None => optimizer.into(),
        }
    }
}

/// An offload refused on this device, as the run's error.
fn refused(error: HostOffloadError) -> Error {
    Error::InvalidConfig(error.to_string())
}
