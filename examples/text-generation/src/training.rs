//! Training either model through burn-train's `Learner`, as Burn's example does: the same
//! data, order, optimizer and learning-rate schedule for both.

use std::path::Path;
use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder, Dataset};
use burn::lr_scheduler::noam::NoamLrSchedulerConfig;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::metric::Adaptor;
use burn::train::metric::{LossInput, LossMetric};
use burn::train::{
    ExecutionStrategy, InferenceStep, Learner, LearnerModel, LearningResult, SupervisedTraining,
    TrainStep, TrainingStrategy,
};
use burn_memwall::optim::InBackwardTraining;

use crate::data::{ByteTokenizer, TextGenerationBatcher, TrainingTextGenerationBatch, text_items};
use crate::{memwall, model};

/// Which `model.rs` trains.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
pub enum Variant {
    /// [`model`]: Burn's layers, the full logits, the optimizer after backward.
    Burn,
    /// [`memwall`]: the same model swapped to burn-memwall.
    Memwall,
}

/// The run, as Burn's example's `ExperimentConfig` (without gradient accumulation, which
/// updates during backward cannot do: each parameter is updated as soon as one batch's
/// gradient is complete).
#[derive(Config, Debug)]
pub struct ExperimentConfig {
    pub transformer: TransformerEncoderConfig,
    pub optimizer: AdamConfig,
    #[config(default = 512)]
    pub max_seq_length: usize,
    #[config(default = 6)]
    pub batch_size: usize,
    #[config(default = 1)]
    pub num_epochs: usize,
    /// Noam's scale factor (Burn's example: 0.01 over its accumulation of 6).
    #[config(default = 0.01)]
    pub learning_rate: f64,
    #[config(default = 100)]
    pub warmup_steps: usize,
    /// Seeds the parameters, the shuffling and the dropout.
    #[config(default = 42)]
    pub seed: u64,
    /// The swapped model's encoder as reversible couplings
    /// (`FlashTransformerEncoder::with_reversible`): another function of the same parameters,
    /// which only [`Variant::Memwall`] has.
    #[config(default = false)]
    pub reversible: bool,
}

impl ExperimentConfig {
    /// Burn's model config for the byte tokenizer.
    pub fn model(&self) -> model::TextGenerationModelConfig {
        model::TextGenerationModelConfig::new(
            self.transformer.clone(),
            ByteTokenizer.vocab_size(),
            ByteTokenizer::PAD_TOKEN,
            self.max_seq_length,
        )
    }

    /// The same config for the swapped model.
    pub fn memwall_model(&self) -> memwall::TextGenerationModelConfig {
        memwall::TextGenerationModelConfig::new(
            self.transformer.clone(),
            ByteTokenizer.vocab_size(),
            ByteTokenizer::PAD_TOKEN,
            self.max_seq_length,
        )
        .with_reversible(self.reversible)
    }

    /// Refuses a run of `variant` that this config cannot give it.
    ///
    /// # Errors
    /// Reversible blocks asked of Burn's model.
    pub fn check_variant(&self, variant: Variant) -> Result<(), String> {
        match (variant, self.reversible) {
            (Variant::Burn, true) => Err("reversible blocks are burn-memwall's: train, measure \
                 or generate them with the memwall model"
                .into()),
            _ => Ok(()),
        }
    }
}

/// Trains `variant` on `train_text`, validating on `valid_text`, with the run's files (burn-train's
/// metric logs and checkpoints) in `artifact_dir`, and at the end the trained model
/// (`MODEL_FILE`) and the run's config (`CONFIG_FILE`).
///
/// # Errors
/// A config the variant cannot run, the error that stopped the run, or that saving the model
/// met.
pub fn train(
    device: &Device,
    train_text: &str,
    valid_text: &str,
    config: &ExperimentConfig,
    variant: Variant,
    artifact_dir: &Path,
) -> Result<(), String> {
    config.check_variant(variant)?;
    let autodiff = device.clone().autodiff();
    autodiff.seed(config.seed);
    let loaders = (
        loader(train_text, config, Some(config.seed), device),
        loader(valid_text, config, None, device),
    );
    let optimizer = config.optimizer.init();
    let scheduler = NoamLrSchedulerConfig::new(config.learning_rate)
        .with_warmup_steps(config.warmup_steps)
        .with_model_size(config.transformer.d_model)
        .init()?;
    match variant {
        Variant::Burn => {
            let model = config.model().init(&autodiff);
            let strategy = ExecutionStrategy::SingleDevice(autodiff.clone()).into();
            let learner = Learner::new(model, optimizer, scheduler);
            let result = launch(learner, strategy, loaders, config, artifact_dir);
            save(result, config, artifact_dir)
        }
        Variant::Memwall => {
            let model = config.memwall_model().init(&autodiff);
            // burn-train's own loop keeps a second handle on the model while it optimizes,
            // which would hold every old weight beside its update.
            let strategy = InBackwardTraining::new(autodiff, optimizer.clone(), scheduler.clone())
                .with_checkpoints(artifact_dir.join("checkpoint"))
                .with_in_backward(model.in_backward().clone());
            let strategy = TrainingStrategy::Custom(Arc::new(strategy));
            let learner = Learner::new(model, optimizer, scheduler);
            let result = launch(learner, strategy, loaders, config, artifact_dir);
            save(result, config, artifact_dir)
        }
    }
}

/// The trained model's file in a run's folder: a burnpack record, which either variant loads,
/// since the swapped model keeps every parameter path of Burn's.
pub const MODEL_FILE: &str = "model.bpk";
/// The run's [`ExperimentConfig`] in a run's folder.
pub const CONFIG_FILE: &str = "config.json";

/// The run's end: its error, or its model and config saved in `artifact_dir`.
fn save<M: Module>(
    result: LearningResult<M>,
    config: &ExperimentConfig,
    artifact_dir: &Path,
) -> Result<(), String> {
    if let Some(error) = result.error {
        return Err(error.to_string());
    }
    let model_file = artifact_dir.join(MODEL_FILE);
    result
        .model
        .save_file(&model_file)
        .map_err(|error| format!("saving {}: {error}", model_file.display()))?;
    let config_file = artifact_dir.join(CONFIG_FILE);
    config
        .save(&config_file)
        .map_err(|error| format!("saving {}: {error}", config_file.display()))
}

type Loader = Arc<dyn DataLoader<TrainingTextGenerationBatch>>;

/// Batches of `text`'s items, shuffled when given a seed.
fn loader(text: &str, config: &ExperimentConfig, shuffle: Option<u64>, device: &Device) -> Loader {
    let items = text_items(text, config.max_seq_length + 1);
    assert!(
        items.len() >= config.batch_size,
        "the text makes {} items of up to {} characters, fewer than a batch of {}",
        items.len(),
        config.max_seq_length + 1,
        config.batch_size
    );
    let builder = DataLoaderBuilder::new(TextGenerationBatcher::new(
        ByteTokenizer,
        config.max_seq_length,
    ))
    .batch_size(config.batch_size)
    .set_device(device.clone());
    let builder = match shuffle {
        Some(seed) => builder.shuffle(seed),
        None => builder,
    };
    builder.build(items)
}

fn launch<M>(
    learner: Learner<M>,
    strategy: TrainingStrategy<M>,
    (train, valid): (Loader, Loader),
    config: &ExperimentConfig,
    artifact_dir: &Path,
) -> LearningResult<M>
where
    M: LearnerModel
        + TrainStep<Input = TrainingTextGenerationBatch>
        + InferenceStep<Input = TrainingTextGenerationBatch>
        + 'static,
    <M as TrainStep>::Output: Adaptor<LossInput>,
    <M as InferenceStep>::Output: Adaptor<LossInput>,
{
    let training = SupervisedTraining::new(artifact_dir, train, valid)
        .metrics((LossMetric::new(),))
        .num_epochs(config.num_epochs)
        .summary();
    // `InBackwardTraining` writes its own checkpoints, one tensor at a time.
    let training = match &strategy {
        TrainingStrategy::Default(_) => training.with_default_checkpointers(),
        TrainingStrategy::Custom(_) => training,
    };
    training.with_training_strategy(strategy).launch(learner)
}
