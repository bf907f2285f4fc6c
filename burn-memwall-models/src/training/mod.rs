//! Training the reference model through burn-train's `Learner`, with checkpoints every epoch and
//! an exact `--resume`.

mod curve;
mod loader;
mod measure;
mod optimizer;
mod plan;
mod progress;
mod schedule;
mod stack;
mod step;
mod stepping;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::config::Config;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::module::Module;
use burn::prelude::*;
use burn::train::metric::{LearningRateMetric, LossMetric};
use burn::train::{Interrupter, Learner, SupervisedTraining, TrainingStrategy};
use burn_memwall::memory::MemoryMeter;
use burn_memwall::optim::{
    CheckpointFiles, HostOffload, InBackwardTraining, LossScaleConfig, LossScaleRecord, StepMemory,
};

pub use curve::LossCurve;
pub use loader::EpochLoader;
pub use measure::{StepMeasurement, measure_training_steps};
pub use optimizer::{BlockSchedule, Precision, StepOptimizer};
pub use plan::{Candidate, Plan};
pub use progress::{EpochRecord, ProgressLog, ProgressRenderer};
pub use stack::{
    NamedSwitches, Overrides, PARTS, ScheduleOverrides, Stack, Switches, every_stack, find_stack,
};
pub use step::{LmOutput, MeanLoss, PerplexityFromLoss};

use crate::Error;
use crate::checkpoint::{save_safetensors, write_atomically};
use crate::data::{Corpus, CorpusIdentity, LmBatcher, TokenWindows};
use crate::llama::save_llama;
use crate::lm::{LanguageModel, LinearKind, LmConfig, LoraConfig, save_adapters};
use crate::pretrained::Pretrained;
use stepping::Stepping;

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
    /// Train one block of the model at a time (BAdam): the optimizer then holds the state of
    /// one block only.
    pub block_coordinate: Option<BlockSchedule>,
    /// Keep the optimizer's state in host memory between updates
    /// ([`burn_memwall::optim::HostOffloaded`]), or keep it there and run the update there
    /// too ([`burn_memwall::optim::HostStepped`]): devices with memory of their own only.
    pub host_offload: Option<HostOffload>,
    /// Seeds the weights and the data order.
    #[config(default = 42)]
    pub seed: u64,
    /// The float type of the weights and activations (the device's default float type, set
    /// when it starts), and how half-precision weights take their updates.
    #[config(default = "Precision::F32")]
    pub precision: Precision,
    /// The dynamic loss scale of a run in f16 (unused in f32 and bf16).
    #[config(default = "LossScaleConfig::new()")]
    pub loss_scale: LossScaleConfig,
    /// Train LoRA adapters on the blocks' linears, everything else frozen (with a
    /// [`RunConfig::base`] to fine-tune, usually).
    pub lora: Option<LoraConfig>,
}

impl TrainingConfig {
    /// The settings a resume may change on purpose (`Start::Resume`'s `allow_change`): each
    /// takes effect from the resumed step on and leaves the checkpoint's state valid (Burn's
    /// scheduler records hold step counts, not rates; an optimizer's records are the same with
    /// its state in host memory or on the device, but for the update on the host, whose masters
    /// they keep: no resume turns that one on or off; a block schedule's records are the same
    /// with the waiting blocks' weights in host memory or on the device, and `weights_on_host`
    /// names that setting of [`Self::block_coordinate`]).
    pub const RESUME_MAY_CHANGE: [&str; 6] = [
        "learning_rate",
        "final_learning_rate",
        "weight_decay",
        "max_validation_steps",
        "host_offload",
        "weights_on_host",
    ];

    /// Checks the numbers once, before anything is built or written.
    ///
    /// # Errors
    /// A rate or decay that is not finite or not positive, a count of 0, or batches per epoch
    /// whose windows overflow.
    pub fn validate(&self) -> Result<(), Error> {
        let fail = |message: String| Err(Error::Training(message));
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return fail(format!(
                "the learning rate must be finite and positive, got {}",
                self.learning_rate
            ));
        }
        if !(self.final_learning_rate.is_finite() && self.final_learning_rate >= 0.0) {
            return fail(format!(
                "the final learning rate must be finite and not negative, got {}",
                self.final_learning_rate
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return fail(format!(
                "the weight decay must be finite and not negative, got {}",
                self.weight_decay
            ));
        }
        if let Err(error) = self.loss_scale.try_init() {
            return fail(error.to_string());
        }
        for (name, value) in [
            ("sequence length", Some(self.seq_len)),
            ("batch size", Some(self.batch_size)),
            ("number of epochs", Some(self.epochs)),
            ("number of steps per epoch", self.max_steps_per_epoch),
            ("number of validation steps", self.max_validation_steps),
            (
                "number of steps per block",
                self.block_coordinate.map(|schedule| schedule.switch_every),
            ),
        ] {
            if value == Some(0) {
                return fail(format!("the {name} must be positive"));
            }
        }
        for steps in [self.max_steps_per_epoch, self.max_validation_steps]
            .into_iter()
            .flatten()
        {
            if steps.checked_mul(self.batch_size).is_none() {
                return fail(format!(
                    "{steps} steps of {} windows overflow a count of windows",
                    self.batch_size
                ));
            }
        }
        Ok(())
    }
}

/// The model and training configs of a run.
#[derive(Config, Debug, PartialEq)]
pub struct RunConfig {
    pub model: LmConfig,
    pub training: TrainingConfig,
    /// The trained model to start from (a [`Pretrained`] folder), instead of drawn weights.
    /// `model` must be its config, but for the attention, the loss and the savers.
    pub base: Option<PathBuf>,
}

impl RunConfig {
    /// Checks that the configs hold together, and with the base model's.
    fn validate(&self) -> Result<(), Error> {
        self.model.validate()?;
        self.training.validate()?;
        if let Some(lora) = &self.training.lora {
            lora.validate(&self.model)?;
        }
        if self.training.precision.half_update().is_some()
            && matches!(
                self.model.linear,
                LinearKind::Counter | LinearKind::CounterAll
            )
        {
            return Err(Error::InvalidConfig(
                "counter-coded linears train in f32 only: their codes decode and update in f32"
                    .into(),
            ));
        }
        if self.training.block_coordinate.is_some() && self.model.linear != LinearKind::Dense {
            return Err(Error::InvalidConfig(
                "block-coordinate training needs dense linears: a counter code updates itself \
                 in its own backward, with no optimizer state to drop"
                    .into(),
            ));
        }
        if let Some(dir) = &self.base {
            let base = Pretrained::open(dir)?.config()?;
            // Attention, loss and savers compute the same function whichever is chosen.
            let comparable = LmConfig {
                attention: self.model.attention,
                loss: self.model.loss,
                savers: self.model.savers,
                saved_precision: self.model.saved_precision,
                ..base
            };
            let changed = differences(&comparable, &self.model);
            if !changed.is_empty() {
                return Err(Error::InvalidConfig(format!(
                    "the model must be the config of {} but for attention, loss and savers ({})",
                    dir.display(),
                    listed(&changed)
                )));
            }
        }
        Ok(())
    }

    /// The model before the first step on `device`, whose RNG is seeded: drawn, then the
    /// base's weights when `with_base`, then LoRA adapters for a LoRA run.
    fn initial_model(&self, device: &Device, with_base: bool) -> Result<LanguageModel, Error> {
        let mut model = self.model.init(device)?;
        if let (Some(dir), true) = (&self.base, with_base) {
            model = Pretrained::open(dir)?.load_weights(model, &self.model)?;
        }
        Ok(match &self.training.lora {
            Some(lora) => model.with_lora(lora),
            None => model,
        })
    }

    /// Writes what the run trained: `model.safetensors` (LoRA adapters merged), the adapters
    /// alone in `adapters.safetensors` for a LoRA run, and a Llama folder `llama/` with the
    /// base's tokenizer files for a run that started from one. Returns the merged model.
    fn export(
        &self,
        trained: LanguageModel,
        artifacts: &Artifacts,
    ) -> Result<LanguageModel, Error> {
        if self.training.lora.is_some() {
            save_adapters(&trained, &artifacts.adapters())?;
        }
        let model = trained.materialize();
        save_safetensors(&model, artifacts.weights())?;
        if let Some(dir) = &self.base
            && let Pretrained::Llama(base) = Pretrained::open(dir)?
        {
            let export = artifacts.llama_export();
            save_llama(&model, &self.model, &export)?;
            for file in LLAMA_TOKENIZER_FILES {
                let source = base.join(file);
                if source.exists() {
                    std::fs::copy(&source, export.join(file))
                        .map_err(|error| Error::io(&source, error))?;
                }
            }
        }
        Ok(model)
    }
}

/// The files beside a Llama checkpoint's weights that tools read its tokenizer from.
const LLAMA_TOKENIZER_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

/// `run.json`: everything that shapes a run, written before its first step so that a resume can
/// refuse any difference.
#[derive(Config, Debug)]
struct RunRecord {
    run: RunConfig,
    corpus: CorpusIdentity,
    /// One line per resume that changed a setting on purpose.
    history: Vec<String>,
}

/// How [`train`] treats what its artifacts folder already holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    /// A new run; refused if the folder holds one.
    Fresh,
    /// A new run, after deleting what the folder's run wrote.
    Overwrite,
    /// Continue the folder's run from its newest checkpoint that loads whole. Every setting
    /// and input must be the run's own, but the number of epochs and the settings named in
    /// `allow_change` (of [`TrainingConfig::RESUME_MAY_CHANGE`]), which `run.json` records.
    Resume { allow_change: Vec<String> },
}

impl Start {
    /// A resume that changes nothing but the number of epochs.
    pub fn resume() -> Self {
        Self::Resume {
            allow_change: Vec::new(),
        }
    }
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
    /// The epoch a resume started after.
    pub resumed_from: Option<usize>,
    /// Where the loss scale ended, and how many updates it skipped, in f16.
    pub loss_scale: Option<LossScaleRecord>,
    /// The trained model (on the device, without autodiff; LoRA adapters merged).
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

    fn run_record(&self) -> PathBuf {
        self.dir.join("run.json")
    }

    /// The run's tokenizer, written before its first step; a resume reads the run's own.
    pub fn tokenizer(&self) -> PathBuf {
        self.dir.join("tokenizer.json")
    }

    /// Where `train` draws the loss curve.
    pub fn loss_plot(&self) -> PathBuf {
        self.dir.join("loss.svg")
    }

    /// Whether the folder holds a run (its record or its checkpoints).
    pub fn holds_run(&self) -> bool {
        self.run_record().exists() || self.checkpoint_folder().exists()
    }

    /// Where the checkpoints go (burn-train's default place).
    fn checkpoint_folder(&self) -> PathBuf {
        self.dir.join("checkpoint")
    }

    fn checkpoint(&self, kind: &str, epoch: usize) -> PathBuf {
        self.checkpoint_folder().join(format!("{kind}-{epoch}.bpk"))
    }

    /// Where the final weights are exported (LoRA adapters merged).
    pub fn weights(&self) -> PathBuf {
        self.dir.join("model.safetensors")
    }

    /// Where a LoRA run exports its adapters alone ([`crate::lm::load_adapters`] reads them).
    pub fn adapters(&self) -> PathBuf {
        self.dir.join("adapters.safetensors")
    }

    /// Where a run that started from a Llama checkpoint exports the trained model as one
    /// ([`crate::llama::load_llama`] and transformers read it).
    pub fn llama_export(&self) -> PathBuf {
        self.dir.join("llama")
    }

    /// The model config of the finished run (from `run.json`); its weights are
    /// [`Self::weights`] and its tokenizer [`Self::tokenizer`]
    /// ([`Pretrained::Run`](crate::pretrained::Pretrained) loads them).
    ///
    /// # Errors
    /// When the folder holds no run, or its run has not exported its model.
    pub fn trained_config(&self) -> Result<LmConfig, Error> {
        let record_path = self.run_record();
        let record = RunRecord::load(&record_path).map_err(|error| Error::Checkpoint {
            path: record_path.clone(),
            reason: format!("no run's record here ({error})"),
        })?;
        if !self.weights().exists() {
            return Err(Error::Checkpoint {
                path: self.weights(),
                reason: "missing: the run exports its model when its last epoch ends".into(),
            });
        }
        Ok(record.run.model)
    }

    /// The loss of every training step and every epoch's validation loss, over all the
    /// checkpointed epochs of the run (resumed parts included).
    ///
    /// # Errors
    /// If the metric log of a checkpointed epoch is missing or unreadable.
    pub fn loss_curve(&self) -> Result<LossCurve, Error> {
        LossCurve::read(&self.dir, self.last_complete_epoch().unwrap_or(0))
    }

    /// Deletes what a run writes into the folder, and nothing else in it.
    fn clear(&self) -> Result<(), Error> {
        for folder in [
            self.checkpoint_folder(),
            self.dir.join("train"),
            self.dir.join("valid"),
            self.llama_export(),
        ] {
            if folder.exists() {
                std::fs::remove_dir_all(&folder).map_err(|e| Error::io(&folder, e))?;
            }
        }
        let files = [
            self.run_record(),
            self.tokenizer(),
            self.weights(),
            self.adapters(),
            self.loss_plot(),
            self.dir.join("experiment.log"),
        ];
        for file in files {
            if file.exists() {
                std::fs::remove_file(&file).map_err(|e| Error::io(&file, e))?;
            }
        }
        Ok(())
    }

    /// Records a new run: its tokenizer first, then `run.json`, which marks the folder as
    /// holding a run.
    fn start(&self, record: &RunRecord, corpus: &Corpus) -> Result<(), Error> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        corpus.tokenizer().save(self.tokenizer())?;
        write_atomically(&self.run_record(), record.to_string().as_bytes())
    }

    /// The last epoch whose model, optimizer and scheduler were all written.
    pub fn last_complete_epoch(&self) -> Option<usize> {
        self.complete_epochs().last().copied()
    }

    /// The epochs whose model, optimizer and scheduler were all written, in order. Each file
    /// is written whole or not at all, one after the other, so after a crash during a
    /// checkpoint only some may exist for the last epoch.
    fn complete_epochs(&self) -> Vec<usize> {
        let Ok(entries) = std::fs::read_dir(self.checkpoint_folder()) else {
            return Vec::new();
        };
        let mut epochs: Vec<usize> = entries
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
            .collect();
        epochs.sort_unstable();
        epochs
    }

    /// Reads back every file of `epoch`'s checkpoint: the model into `run`'s model, then the
    /// optimizer and scheduler records (and the per-parameter optimizer state of a run that
    /// steps in backward, the loss scale of one in f16). Each is dropped once read.
    fn verify_checkpoint(
        &self,
        run: &RunConfig,
        epoch: usize,
        device: &Device,
    ) -> Result<(), String> {
        let model = run
            .initial_model(device, false)
            .map_err(|e| e.to_string())?;
        model
            .try_load_file(self.checkpoint("model", epoch))
            .map_err(|e| format!("model: {e}"))?;
        InBackwardTraining::verify_checkpoint(
            self.checkpoint_folder(),
            epoch,
            CheckpointFiles {
                states_per_parameter: run.training.optimizer.in_backward().is_some(),
                loss_scale: run.training.precision.scales_loss(),
                block_coordinate: run.training.block_coordinate.is_some(),
            },
        )
        .map_err(|e| e.to_string())
    }
}

/// Trains `run` on `corpus` through the Learner on `device`, checkpointing each epoch into
/// `artifacts`. `start` says what to do with a run the folder already holds: refuse, replace
/// it, or resume it from its newest checkpoint that loads whole, giving the same losses and
/// learning rates as a run that was never interrupted. A step whose loss is not finite stops
/// the run there, with an error naming it; no checkpoint of its epoch is kept.
///
/// On a resume Burn 0.22.1 loads the optimizer state onto its default device before the first
/// step moves it to `device`: make `device` Burn's default
/// ([`DeviceChoice::start_as_default`](burn_memwall::DeviceChoice::start_as_default)), or that
/// state passes through another device's memory.
pub fn train(
    run: &RunConfig,
    corpus: &Corpus,
    device: &Device,
    artifacts: &Artifacts,
    start: &Start,
    quiet: bool,
) -> Result<TrainReport, Error> {
    run.validate()?;
    // Before anything is written: a run this device cannot take leaves no folder behind.
    let mut stepping = run.stepping(device)?;
    let RunConfig {
        model: model_config,
        training,
        ..
    } = run;
    let scheduler = training.lr_scheduler()?;
    if training.seq_len > model_config.max_seq_len {
        return Err(Error::SequenceTooLong {
            seq_len: training.seq_len,
            max_seq_len: model_config.max_seq_len,
        });
    }
    let windows = |tokens: &[u32], split: &str| {
        TokenWindows::new(tokens.into(), training.seq_len, model_config.vocab_size).map_err(|e| {
            match e {
                Error::Data(message) => Error::Data(format!("{split} split: {message}")),
                other => other,
            }
        })
    };
    let train_windows = windows(corpus.train(), "training")?;
    let valid_windows = windows(corpus.valid(), "validation")?;
    let identity = corpus.identity()?;

    let start_epoch = match start {
        Start::Resume { allow_change } => {
            let resumed = resume_point(run, &identity, allow_change, artifacts, device)?;
            if !quiet {
                for (epoch, reason) in &resumed.skipped {
                    eprintln!("checkpoint of epoch {epoch} does not load ({reason}); skipped");
                }
            }
            resumed.epoch
        }
        Start::Fresh | Start::Overwrite => {
            if artifacts.holds_run() {
                if *start == Start::Fresh {
                    return Err(Error::Checkpoint {
                        path: artifacts.dir().into(),
                        reason: "holds a run already: resume it (--resume), or replace it \
                                 (--overwrite)"
                            .into(),
                    });
                }
                artifacts.clear()?;
            }
            let record = RunRecord::new(run.clone(), identity, Vec::new());
            artifacts.start(&record, corpus)?;
            0
        }
    };
    if start_epoch >= training.epochs {
        return Err(Error::Training(format!(
            "the checkpoint is already at epoch {start_epoch} of {}; raise the number of epochs to continue",
            training.epochs
        )));
    }

    let meter = MemoryMeter::new(device);
    let live_before = meter.live_bytes();
    device.seed(training.seed);
    let (model, _) =
        stepping.prepare(run.initial_model(&device.clone().autodiff(), start_epoch == 0)?);
    let train_loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(training.batch_size)
        .shuffle(training.seed)
        .set_device(device.clone())
        .build(train_windows);
    let train_loader = EpochLoader::new(
        train_loader,
        training
            .max_steps_per_epoch
            .map(|steps| steps * training.batch_size),
        start_epoch,
    );
    let steps_per_epoch = train_loader.num_items().div_ceil(training.batch_size);
    let valid_loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(training.batch_size)
        .set_device(device.clone())
        .build(valid_windows);
    let valid_loader = EpochLoader::new(
        valid_loader,
        training
            .max_validation_steps
            .map(|steps| steps * training.batch_size),
        0,
    );

    let interrupter = Interrupter::new();
    let (renderer, progress) = ProgressRenderer::new(training.seq_len, quiet);
    let renderer =
        renderer.stopping_on_divergence(interrupter.clone(), start_epoch * steps_per_epoch);
    let Stepping {
        in_backward,
        loss_scale,
        optimizer,
        block_coordinate,
    } = stepping;
    // burn-train's own loop keeps a second handle on the model while it optimizes, which
    // would hold every old weight beside its in-backward update.
    let mut strategy =
        InBackwardTraining::new(device.clone(), optimizer.clone(), scheduler.clone())
            .with_checkpoints(artifacts.checkpoint_folder())
            .with_step_memory(meter.clone());
    if let Some(in_backward) = in_backward {
        strategy = strategy.with_in_backward(in_backward);
    }
    if let Some(loss_scale) = &loss_scale {
        strategy = strategy.with_loss_scale(loss_scale.clone());
    }
    if let Some(schedule) = block_coordinate {
        strategy = strategy.with_block_coordinate(schedule);
    }
    let strategy = Arc::new(strategy);
    let mut builder = SupervisedTraining::new(artifacts.dir(), train_loader, valid_loader)
        .metrics((LossMetric::new(), PerplexityFromLoss::default()))
        .metric_train_numeric(LearningRateMetric::new())
        .with_training_strategy(TrainingStrategy::Custom(strategy.clone()))
        .with_interrupter(interrupter)
        .renderer(Box::new(renderer))
        .num_epochs(training.epochs);
    if start_epoch > 0 {
        builder = builder.checkpoint(start_epoch);
    }
    let result = builder.launch(Learner::new(model, optimizer, scheduler));
    let progress = progress.lock().expect("progress lock").clone();
    if let Some((step, loss)) = progress.diverged {
        let kept = match artifacts.last_complete_epoch() {
            Some(epoch) => format!("the newest checkpoint is epoch {epoch}'s"),
            None => "no checkpoint was written".into(),
        };
        return Err(Error::Training(format!(
            "the loss was {loss} at step {step} (epoch {}); the run stopped there and {kept}. \
             Lower the learning rate (or lengthen its warm-up)",
            (step - 1) / steps_per_epoch + 1
        )));
    }
    if let Some(error) = result.error {
        return Err(Error::Training(error.to_string()));
    }
    let steps = strategy.step_memory().unwrap_or_default();
    let step_memory = StepMemory {
        peak_bytes: steps.peak_bytes.saturating_sub(live_before),
        live_bytes: steps.live_bytes.saturating_sub(live_before),
        checkpoint_peak_bytes: steps.checkpoint_peak_bytes.saturating_sub(live_before),
    };
    let epochs = progress.epochs;
    if let Some(diverged) = epochs
        .iter()
        .find(|e| !(e.train_loss.is_finite() && e.valid_loss.is_finite()))
    {
        return Err(Error::Training(format!(
            "the loss was not finite in epoch {} (train {}, validation {}); lower the learning \
             rate",
            diverged.epoch, diverged.train_loss, diverged.valid_loss
        )));
    }
    let model = run.export(result.model, artifacts)?;
    Ok(TrainReport {
        epochs,
        step_memory,
        live_before_bytes: live_before,
        resumed_from: (start_epoch > 0).then_some(start_epoch),
        loss_scale: loss_scale.map(|scale| scale.to_record()),
        model,
    })
}

/// `field: saved → now` for every top-level field where two configs differ.
fn differences<C: Config>(saved: &C, now: &C) -> Vec<(String, String)> {
    let fields = |c: &C| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    let now = fields(now);
    fields(saved)
        .into_iter()
        .filter(|(key, value)| now.get(key) != Some(value))
        .map(|(key, value)| {
            let change = format!(
                "{key}: {value} → {}",
                now.get(&key).unwrap_or(&serde_json::Value::Null)
            );
            (key, change)
        })
        .collect()
}

/// [`differences`] of two training configs, a block schedule that differs only in
/// `weights_on_host` named by that setting (which a resume may change) rather than as
/// `block_coordinate`.
fn training_differences(saved: &TrainingConfig, now: &TrainingConfig) -> Vec<(String, String)> {
    let mut changes = differences(saved, now);
    if let (Some(saved), Some(now)) = (saved.block_coordinate, now.block_coordinate)
        && saved.weights_on_host != now.weights_on_host
        && now
            == (BlockSchedule {
                weights_on_host: now.weights_on_host,
                ..saved
            })
    {
        for (name, change) in &mut changes {
            if name == "block_coordinate" {
                *name = "weights_on_host".into();
                *change = format!(
                    "weights_on_host: {} → {}",
                    saved.weights_on_host, now.weights_on_host
                );
            }
        }
    }
    changes
}

fn listed(changes: &[(String, String)]) -> String {
    changes
        .iter()
        .map(|(_, change)| change.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a resume starts, and the newer checkpoints it passed over.
struct ResumePoint {
    epoch: usize,
    /// `(epoch, why)` for each newer checkpoint that did not load.
    skipped: Vec<(usize, String)>,
}

/// The epoch to resume from, after checking that the folder's run had the same configs (but
/// for the number of epochs and the settings in `allow_change`, which `run.json` then
/// records) and the same inputs, and that every file of that epoch's checkpoint loads.
fn resume_point(
    run: &RunConfig,
    corpus: &CorpusIdentity,
    allow_change: &[String],
    artifacts: &Artifacts,
    device: &Device,
) -> Result<ResumePoint, Error> {
    let record_path = artifacts.run_record();
    let refuse = |reason: String| Error::Checkpoint {
        path: record_path.clone(),
        reason,
    };
    if let Some(unknown) = allow_change
        .iter()
        .find(|name| !TrainingConfig::RESUME_MAY_CHANGE.contains(&name.as_str()))
    {
        return Err(refuse(format!(
            "`{unknown}` cannot change on a resume; these can: {}",
            TrainingConfig::RESUME_MAY_CHANGE.join(", ")
        )));
    }
    let mut record =
        RunRecord::load(&record_path).map_err(|e| refuse(format!("cannot resume: {e}")))?;
    let changed = differences(&record.run.model, &run.model);
    if !changed.is_empty() {
        return Err(refuse(format!(
            "was trained with another model config ({})",
            listed(&changed)
        )));
    }
    if record.run.base != run.base {
        return Err(refuse(format!(
            "was started from {:?}, not {:?}",
            record.run.base, run.base
        )));
    }
    let changed = differences(&record.corpus, corpus);
    if !changed.is_empty() {
        return Err(refuse(format!(
            "was trained on other data or with another tokenizer ({}); a resume must read \
             the same text with the run's own tokenizer.json",
            listed(&changed)
        )));
    }
    // Every other training setting shapes the steps a resume runs.
    let comparable = TrainingConfig {
        epochs: run.training.epochs,
        ..record.run.training.clone()
    };
    let (allowed, refused): (Vec<_>, Vec<_>) = training_differences(&comparable, &run.training)
        .into_iter()
        .partition(|(name, _)| allow_change.contains(name));
    if !refused.is_empty() {
        return Err(refuse(format!(
            "was trained with other training settings ({}); only the number of epochs may \
             change for the resume to continue the run exactly, and on purpose {}",
            listed(&refused),
            TrainingConfig::RESUME_MAY_CHANGE.join(", ")
        )));
    }
    let stepped_on_host =
        |training: &TrainingConfig| training.host_offload == Some(HostOffload::Update);
    if stepped_on_host(&record.run.training) != stepped_on_host(&run.training) {
        return Err(refuse(
            "the update on the host keeps an f32 master of each weight in its optimizer's \
             records, the update on the device does not: a resume cannot change between them"
                .into(),
        ));
    }

    let mut skipped = Vec::new();
    for epoch in artifacts.complete_epochs().into_iter().rev() {
        match artifacts.verify_checkpoint(run, epoch, device) {
            Ok(()) => {
                if !allowed.is_empty() {
                    record.history.push(format!(
                        "resumed after epoch {epoch} with {}",
                        listed(&allowed)
                    ));
                }
                if !allowed.is_empty() || record.run.training.epochs != run.training.epochs {
                    record.run.training = run.training.clone();
                    write_atomically(&record_path, record.to_string().as_bytes())?;
                }
                return Ok(ResumePoint { epoch, skipped });
            }
            Err(reason) => skipped.push((epoch, reason)),
        }
    }
    let tried = skipped
        .iter()
        .map(|(epoch, reason)| format!("epoch {epoch}: {reason}"))
        .collect::<Vec<_>>()
        .join("; ");
    Err(Error::Checkpoint {
        path: artifacts.checkpoint_folder(),
        reason: if tried.is_empty() {
            "no complete checkpoint (model, optim and scheduler of one epoch) to resume from".into()
        } else {
            format!("no checkpoint loads whole ({tried})")
        },
    })
}
