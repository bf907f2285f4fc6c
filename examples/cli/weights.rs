//! The flags that say how the weights train, shared by `train`, `memgate` and `budget`.

use burn_memwall_models::Error;
use burn_memwall_models::lm::StepShape;
use burn_memwall_models::training::Precision;

/// The weights' float type, how half-precision weights take their updates, and LoRA.
#[derive(clap::Args, Clone, Debug)]
pub struct WeightArgs {
    /// The float type of the weights, activations and gradients: f32, bf16 or f16 (half the
    /// bytes; the optimizer steps in f32, its state in f32). f16 trains with a dynamic loss
    /// scale, since its range would flush gradients to zero; bf16 has f32's range.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// How bf16 or f16 weights take their updates: `masters` (an f32 master copy of each, 4
    /// more bytes per weight) or `stochastic-rounding` (of the weight itself, no copy).
    #[arg(long, default_value = "masters")]
    pub half_update: String,
    /// Train LoRA adapters of this rank on the blocks' linears, everything else frozen.
    #[arg(long)]
    pub lora: Option<usize>,
}

impl WeightArgs {
    /// The precision the flags name.
    ///
    /// # Errors
    /// An unknown float type or update, naming the ones there are.
    pub fn precision(&self) -> Result<Precision, Error> {
        Precision::from_names(&self.precision, &self.half_update)
    }

    /// The shape of a step of `batch` sequences of `seq` tokens in `precision`, with these
    /// flags' LoRA adapters: what the budget predicts.
    pub fn step_shape(&self, precision: Precision, batch: usize, seq: usize) -> StepShape {
        StepShape::new(batch, seq, precision.dtype().into()).with_lora_rank(self.lora)
    }
}
