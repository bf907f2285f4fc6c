//! Training the reference model through burn-train's `Learner`, with checkpoints every epoch and
//! an exact `--resume`.

mod curve;
mod loader;
mod measure;
mod optimizer;
mod progress;
mod schedule;
mod stack;
mod step;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::config::Config;
use burn::data::dataloader::DataLoaderBuilder;
use burn::module::Module;
use burn::prelude::*;
use burn::train::metric::LossMetric;
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};
use burn_memwall::memory::MemoryMeter;
use burn_memwall::optim::{InBackwardTraining, StepMemory};

pub use curve::LossCurve;
pub use loader::EpochLoader;
pub use measure::{StepMeasurement, measure_steps};
pub use optimizer::StepOptimizer;
pub use progress::{EpochRecord, ProgressRenderer};
pub use stack::{Stack, Switches};
pub use step::{LmOutput, MeanLoss, PerplexityFromLoss};

use crate::Error;
use crate::checkpoint::{save_safetensors, write_atomically};
use crate::data::{LmBatcher, TokenWindows};
use crate::lm::{LanguageModel, LmConfig};

/// How to train: everything but the model shape and the data.
#[derive(Config, Debug, PartialEq)]
pub struct TrainingConfig {
    /// Tokens per training window.
    #[config(default = 128)]
    pub seq_len: usize,
    /// Windows per batch.
    #[config(default = 8)]
    pub batch_size: usize,
    /// Total epochs (a resumed run continues up to this number).
    #[config(default = 10)]
    pub epochs: usize,
    /// Stop each epoch's training split after this many batches.
    pub max_steps_per_epoch: Option<usize>,
    /// Cap on validation batches after each epoch (the same first batches every epoch).
    pub max_validation_steps: Option<usize>,
    /// The learning rate after the warm-up and before the decay (see
    /// [`TrainingConfig::lr_scheduler`]).
    #[config(default = 3e-3)]
    pub learning_rate: f64,
    /// Steps of linear warm-up up to `learning_rate` (0: none).
    #[config(default = 0)]
    pub warmup_steps: usize,
    /// Steps of cosine decay after the warm-up, from `learning_rate` down to
    /// `final_learning_rate`, which then stays (0: none; `learning_rate` stays).
    #[config(default = 0)]
    pub decay_steps: usize,
    /// Where the decay ends.
    #[config(default = 0.0)]
    pub final_learning_rate: f64,
    /// AdamW decoupled weight decay.
    #[config(default = 0.01)]
    pub weight_decay: f32,
    /// The optimizer, and whether it steps during backward
    /// ([`burn_memwall::optim::InBackward`]: the same updates, without a gradient pool).
    #[config(default = "StepOptimizer::AdamW")]
    pub optimizer: StepOptimizer,
    /// Seeds the weights and the data order.
    #[config(default = 42)]
    pub seed: u64,
    /// Share of the tokens held out for validation.
    #[config(default = 0.1)]
    pub validation_fraction: f64,
}

/// The model and training configs of an artifacts folder, saved so a resume can check them.
#[derive(Config, Debug, PartialEq)]
pub struct RunConfig {
    pub model: LmConfig,
    pub training: TrainingConfig,
}

/// What a finished run measured.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// One record per epoch trained by this run (not the resumed-from ones).
    pub epochs: Vec<EpochRecord>,
    /// What the training steps held, above what was live before the run: the highest step
    /// peak and the persistent state after the last step (see [`StepMemory`]'s units).
    pub step_memory: StepMemory,
    /// What was live before the run built its model, in the same units.
    pub live_before_bytes: u64,
    /// The trained model (on the device, without autodiff).
    pub model: LanguageModel,
}

/// An artifacts folder: `run.json`, `checkpoint/{model,optim,scheduler}-N.bpk` (with
/// `optim-N-parameters/` for an in-backward optimizer's state), metric logs and, at the end,
/// `model.safetensors`.
#[derive(Clone, Debug)]
pub struct Artifacts {
    dir: PathBuf,
}

impl Artifacts {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn run_config(&self) -> PathBuf {
        self.dir.join("run.json")
    }

    /// Where the checkpoints go (burn-train's default place).
    fn checkpoint_folder(&self) -> PathBuf {
        self.dir.join("checkpoint")
    }

    fn checkpoint(&self, kind: &str, epoch: usize) -> PathBuf {
        self.checkpoint_folder().join(format!("{kind}-{epoch}.bpk"))
    }

    /// Where the final weights are exported.
    pub fn weights(&self) -> PathBuf {
        self.dir.join("model.safetensors")
    }

    /// The loss of every training step and every epoch's validation loss, over all the
    /// checkpointed epochs of the run (resumed parts included).
    ///
    /// # Errors
    /// If the metric log of a checkpointed epoch is missing or unreadable.
    pub fn loss_curve(&self) -> Result<LossCurve, Error> {
        LossCurve::read(&self.dir, self.last_complete_epoch().unwrap_or(0))
    }

    /// Clears what an earlier run left (so a later resume cannot pick up its checkpoints) and
    /// records `run`.
    fn start_fresh(&self, run: &RunConfig) -> Result<(), Error> {
        for stale in ["checkpoint", "train", "valid"] {
            let path = self.dir.join(stale);
            if path.exists() {
                std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
            }
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        write_atomically(&self.run_config(), run.to_string().as_bytes())
    }

    /// The last epoch whose model, optimizer and scheduler were all written. Each file is
    /// written whole or not at all, one after the other, so after a crash during a checkpoint
    /// only some may exist for the last epoch.
    pub fn last_complete_epoch(&self) -> Option<usize> {
        let entries = std::fs::read_dir(self.checkpoint_folder()).ok()?;
        entries
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("model-")?
                    .strip_suffix(".bpk")?
                    .parse::<usize>()
                    .ok()
            })
            .filter(|&epoch| {
                ["optim", "scheduler"]
                    .iter()
                    .all(|kind| self.checkpoint(kind, epoch).exists())
            })
            .max()
    }
}

/// Trains `model_config` on `tokens` through the Learner on `device`, checkpointing each epoch
/// into `artifacts`. With `resume`, continues from the last complete checkpoint there, giving
/// the same losses as a run that was never interrupted.
///
/// On a resume Burn 0.22.1 loads the optimizer state onto its default device before the first
/// step moves it to `device`: make `device` Burn's default
/// ([`DeviceChoice::start_as_default`](burn_memwall::DeviceChoice::start_as_default)), or that
/// state passes through another device's memory.
pub fn train(
    run: &RunConfig,
    tokens: &[u32],
    device: &Device,
    artifacts: &Artifacts,
    resume: bool,
    quiet: bool,
) -> Result<TrainReport, Error> {
    let RunConfig {
        model: model_config,
        training,
    } = run;
    model_config.validate()?;
    let scheduler = training.lr_scheduler()?;
    if training.seq_len > model_config.max_seq_len {
        return Err(Error::SequenceTooLong {
            seq_len: training.seq_len,
            max_seq_len: model_config.max_seq_len,
        });
    }
    if training.batch_size == 0 || training.epochs == 0 {
        return Err(Error::Training(
            "batch size and epochs must be positive".into(),
        ));
    }
    let (train_windows, valid_windows) = TokenWindows::split(
        tokens,
        training.seq_len,
        model_config.vocab_size,
        training.validation_fraction,
    )?;

    let start_epoch = if resume {
        check_resumable(run, artifacts, device)?
    } else {
        0
    };
    if !resume {
        artifacts.start_fresh(run)?;
    }
    if start_epoch >= training.epochs {
        return Err(Error::Training(format!(
            "the checkpoint is already at epoch {start_epoch} of {}; raise the number of epochs to continue",
            training.epochs
        )));
    }

    let meter = MemoryMeter::new(device);
    let live_before = meter.live_bytes();
    device.seed(training.seed);
    let in_backward = training.optimizer.in_backward();
    let model = model_config
        .init(&device.clone().autodiff())?
        .with_in_backward(in_backward.clone());
    // Drawn now, in the model's order, rather than at their first read inside the first step,
    // where they would be allocated between its activations.
    measure::initialize_parameters(&model);
    let train_loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(training.batch_size)
        .shuffle(training.seed)
        .build(train_windows);
    let train_loader = EpochLoader::new(
        train_loader,
        training
            .max_steps_per_epoch
            .map(|steps| steps * training.batch_size),
        start_epoch,
    );
    let valid_loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(training.batch_size)
        .build(valid_windows);
    let valid_loader = EpochLoader::new(
        valid_loader,
        training
            .max_validation_steps
            .map(|steps| steps * training.batch_size),
        0,
    );

    let (renderer, records) = ProgressRenderer::new(training.seq_len, quiet);
    let optimizer = training.optimizer.init(training.weight_decay);
    // burn-train's own loop keeps a second handle on the model while it optimizes, which
    // would hold every old weight beside its in-backward update.
    let mut strategy =
        InBackwardTraining::new(device.clone(), optimizer.clone(), scheduler.clone())
            .with_checkpoints(artifacts.checkpoint_folder())
            .with_step_memory(meter.clone());
    if let Some(in_backward) = in_backward {
        strategy = strategy.with_in_backward(in_backward);
    }
    let strategy = Arc::new(strategy);
    let mut builder = SupervisedTraining::new(artifacts.dir(), train_loader, valid_loader)
        .metrics((LossMetric::new(), PerplexityFromLoss::default()))
        .with_training_strategy(TrainingStrategy::Custom(strategy.clone()))
        .renderer(Box::new(renderer))
        .num_epochs(training.epochs);
    if start_epoch > 0 {
        builder = builder.checkpoint(start_epoch);
    }
    let result = builder.launch(Learner::new(model, optimizer, scheduler));
    if let Some(error) = result.error {
        return Err(Error::Training(error.to_string()));
    }
    let steps = strategy.step_memory().unwrap_or_default();
    let step_memory = StepMemory {
        peak_bytes: steps.peak_bytes.saturating_sub(live_before),
        live_bytes: steps.live_bytes.saturating_sub(live_before),
        checkpoint_peak_bytes: steps.checkpoint_peak_bytes.saturating_sub(live_before),
    };
    let epochs = records.lock().expect("records lock").clone();
    if let Some(diverged) = epochs
        .iter()
        .find(|e| !(e.train_loss.is_finite() && e.valid_loss.is_finite()))
    {
        return Err(Error::Training(format!(
            "the loss diverged in epoch {} (train {}, validation {}); lower the learning rate",
            diverged.epoch, diverged.train_loss, diverged.valid_loss
        )));
    }
    save_safetensors(&result.model, artifacts.weights())?;
    Ok(TrainReport {
        epochs,
        step_memory,
        live_before_bytes: live_before,
        model: result.model,
    })
}

/// `field: saved → now` for every top-level field where two configs differ.
fn differences<C: Config>(saved: &C, now: &C) -> String {
    let fields = |c: &C| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    let now = fields(now);
    fields(saved)
        .into_iter()
        .filter(|(key, value)| now.get(key) != Some(value))
        .map(|(key, value)| {
            format!(
                "{key}: {value} → {}",
                now.get(&key).unwrap_or(&serde_json::Value::Null)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The epoch to resume from, after checking that the folder was made by the same configs (but
/// for the number of epochs) and that its model checkpoint loads into this model.
fn check_resumable(
    run: &RunConfig,
    artifacts: &Artifacts,
    device: &Device,
) -> Result<usize, Error> {
    let saved_path = artifacts.run_config();
    let saved = RunConfig::load(&saved_path).map_err(|e| Error::Checkpoint {
        path: saved_path.clone(),
        reason: format!("cannot resume: {e}"),
    })?;
    if saved.model != run.model {
        return Err(Error::Checkpoint {
            path: saved_path,
            reason: format!(
                "was trained with another model config ({})",
                differences(&saved.model, &run.model)
            ),
        });
    }
    // Every training setting but the number of epochs shapes the steps a resume runs.
    let resumable = TrainingConfig {
        epochs: run.training.epochs,
        ..saved.training.clone()
    };
    if resumable != run.training {
        return Err(Error::Checkpoint {
            path: saved_path,
            reason: format!(
                "was trained with other training settings ({}); only the number of epochs may \
                 change for the resume to continue the run exactly",
                differences(&resumable, &run.training)
            ),
        });
    }
    let epoch = artifacts
        .last_complete_epoch()
        .ok_or_else(|| Error::Checkpoint {
            path: artifacts.checkpoint_folder(),
            reason:
                "no complete checkpoint (model, optim and scheduler of one epoch) to resume from"
                    .into(),
        })?;
    let model_path = artifacts.checkpoint("model", epoch);
    run.model
        .init(device)?
        .try_load_file(&model_path)
        .map_err(|e| Error::Checkpoint {
            path: model_path.clone(),
            reason: e.to_string(),
        })?;
    Ok(epoch)
}
