//! Trains Burn's text-generation model, as written for Burn or swapped to burn-memwall,
//! measures one training step of it, or continues a prompt with it.
//!
//! ```text
//! cargo run --release -p text-generation -- train --model memwall [--text FILE] [--seq 512]
//! cargo run --release -p text-generation -- measure --model burn --seq 2048
//! cargo run --release -p text-generation -- measure --model memwall --dropout 0 --reversible
//! cargo run --release -p text-generation -- generate --model memwall --from DIR --prompt TEXT
//! ```
//!
//! `measure` prints one JSON line: the bytes held at the peak of a training step (forward,
//! backward and the optimizer's update, as the `Learner` runs them) above what was live before
//! it, and the step's time. `generate` streams the continuation to stdout and prints a JSON
//! line to stderr: the tokens per second and the bytes held at the peak above the model. Run
//! each model in its own process, so that neither inherits the other's allocator state.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::optim::{AdamConfig, ModuleOptimizer};
use burn::prelude::*;
use burn::train::TrainStep;
use burn_memwall::DeviceChoice;
use burn_memwall::memory::{CountingAllocator, MemoryMeter};
use burn_memwall_models::data::{load_text, split_text};
use clap::{Parser, Subcommand};
use serde::{Deserialize, Serialize};
use text_generation::data::{
    ByteTokenizer, TextGenerationBatcher, TrainingTextGenerationBatch, text_items,
};
use text_generation::training::{CONFIG_FILE, ExperimentConfig, MODEL_FILE, Variant, train};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
#[command(about = "Burn's text-generation example, on Burn or on burn-memwall")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train through burn-train's Learner.
    Train {
        #[command(flatten)]
        run: Run,
        /// Epochs over the text.
        #[arg(long, default_value_t = 1)]
        epochs: usize,
        /// Where burn-train writes its logs and checkpoints.
        #[arg(long, default_value = "artifacts/text-generation")]
        dir: PathBuf,
    },
    /// Print the peak memory and time of one training step as a JSON line.
    Measure {
        #[command(flatten)]
        run: Run,
    },
    /// Continue a prompt greedily, one byte at a time, through the encoder's autoregressive
    /// cache.
    Generate {
        #[command(flatten)]
        run: Run,
        /// A folder `train` wrote (its model and config; either model loads either's); a fresh
        /// model of the size given without it.
        #[arg(long)]
        from: Option<PathBuf>,
        #[arg(long, default_value = "ROMEO:")]
        prompt: String,
        /// Bytes to generate; with the prompt, at most the model's sequence length.
        #[arg(long, default_value_t = 200)]
        tokens: usize,
    },
}

#[derive(clap::Args, Debug)]
struct Run {
    /// `burn`: the model as written for Burn; `memwall`: swapped to burn-memwall.
    #[arg(long, value_enum)]
    model: Variant,
    /// auto, flex, wgpu, vulkan, metal, webgpu, cuda, rocm or cpu.
    #[arg(long, default_value = "auto", env = "BURN_DEVICE")]
    device: String,
    /// A UTF-8 text file; the embedded corpus without one.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Tokens per item (the model's max_seq_length).
    #[arg(long, default_value_t = 512)]
    seq: usize,
    #[arg(long, default_value_t = 6)]
    batch: usize,
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    #[arg(long, default_value_t = 1024)]
    d_ff: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Dropout of every layer (Burn's default 0.1).
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The memwall model's encoder as reversible couplings (needs `--dropout 0`).
    #[arg(long)]
    reversible: bool,
}

impl Run {
    fn config(&self) -> ExperimentConfig {
        let transformer =
            TransformerEncoderConfig::new(self.d_model, self.d_ff, self.heads, self.layers)
                .with_dropout(self.dropout)
                .with_norm_first(true);
        ExperimentConfig::new(transformer, AdamConfig::new())
            .with_max_seq_length(self.seq)
            .with_batch_size(self.batch)
            .with_seed(self.seed)
            .with_reversible(self.reversible)
    }
}

/// What `measure` prints.
#[derive(Serialize, Deserialize, Debug)]
struct StepMeasurement {
    model: Variant,
    device: String,
    seq: usize,
    batch: usize,
    /// Bytes held at the step's peak above what was live before it (the model and the
    /// optimizer state, after a first step made the state).
    peak_bytes: u64,
    step_seconds: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    match Args::parse().command {
        Command::Train { run, epochs, dir } => {
            let device = DeviceChoice::from_arg_or_env(Some(&run.device))?.device()?;
            let text = load_text(run.text.as_deref())?;
            let (train_text, valid_text) = split_text(&text, 0.1)?;
            let config = run.config().with_num_epochs(epochs);
            train(&device, train_text, valid_text, &config, run.model, &dir)?;
            println!("trained; burn-train's logs are in {}", dir.display());
        }
        Command::Measure { run } => {
            let device = DeviceChoice::from_arg_or_env(Some(&run.device))?.device()?;
            let measurement = measure(&run, &device)?;
            println!("{}", serde_json::to_string(&measurement)?);
        }
        Command::Generate {
            run,
            from,
            prompt,
            tokens,
        } => {
            let device = DeviceChoice::from_arg_or_env(Some(&run.device))?.device()?;
            let measurement = generate(&run, from.as_deref(), &prompt, tokens, &device)?;
            eprintln!("{}", serde_json::to_string(&measurement)?);
        }
    }
    Ok(())
}

/// What `generate` prints to stderr.
#[derive(Serialize, Deserialize, Debug)]
struct GenerationMeasurement {
    model: Variant,
    device: String,
    prompt_tokens: usize,
    new_tokens: usize,
    /// Bytes held at the peak of generation above the model: the cache and each step's work.
    peak_bytes: u64,
    /// The first call's time: the whole prompt through the encoder, and one token.
    prompt_seconds: f64,
    /// Tokens per second after the first, one call each.
    tokens_per_second: f64,
}

/// Loads the model (`from`'s, or a fresh one of `run`'s size) and continues `prompt` by
/// `tokens` bytes.
fn generate(
    run: &Run,
    from: Option<&Path>,
    prompt: &str,
    tokens: usize,
    device: &Device,
) -> Result<GenerationMeasurement, Box<dyn std::error::Error>> {
    let config = match from {
        Some(dir) => ExperimentConfig::load(dir.join(CONFIG_FILE))
            .map_err(|error| format!("{}: {error}", dir.join(CONFIG_FILE).display()))?,
        None => run.config(),
    };
    config.check_variant(run.model)?;
    let prompt = ByteTokenizer.encode(prompt);
    if prompt.is_empty() || tokens < 2 || prompt.len() + tokens > config.max_seq_length {
        return Err(format!(
            "a prompt of {} bytes and {tokens} more must fit the model's {} positions (with a \
             prompt and at least 2 tokens to generate)",
            prompt.len(),
            config.max_seq_length
        )
        .into());
    }
    device.seed(config.seed);
    let meter = MemoryMeter::new(device);
    let decoding = Decoding {
        prompt: &prompt,
        tokens,
        device,
        meter: &meter,
    };
    let (peak_bytes, [prompt_seconds, seconds]) = match run.model {
        Variant::Burn => {
            let model = loaded(config.model().init(device), from)?;
            decoding.run(model.new_autoregressive_cache(), |tokens, cache| {
                model.forward_next_token(tokens, cache)
            })?
        }
        Variant::Memwall => {
            let model = loaded(config.memwall_model().init(device), from)?;
            decoding.run(model.new_autoregressive_cache(), |tokens, cache| {
                model.forward_next_token(tokens, cache)
            })?
        }
    };
    Ok(GenerationMeasurement {
        model: run.model,
        device: burn_memwall::device::describe(device),
        prompt_tokens: prompt.len(),
        new_tokens: tokens,
        peak_bytes,
        prompt_seconds,
        tokens_per_second: (tokens - 1) as f64 / seconds,
    })
}

/// `model` with the parameters of `from`'s [`MODEL_FILE`], if given.
fn loaded<M: burn::module::Module>(
    model: M,
    from: Option<&Path>,
) -> Result<M, Box<dyn std::error::Error>> {
    let Some(dir) = from else { return Ok(model) };
    let file = dir.join(MODEL_FILE);
    model
        .try_load_file(&file)
        .map_err(|error| format!("{}: {error}", file.display()).into())
}

/// Greedy decoding of `tokens` bytes after `prompt`, each written to stdout as it comes.
struct Decoding<'a> {
    prompt: &'a [usize],
    tokens: usize,
    device: &'a Device,
    meter: &'a MemoryMeter,
}

impl Decoding<'_> {
    /// Decodes with `next`, which gives the logits after the sequence so far and keeps what it
    /// has seen in `cache`. Returns the bytes held at the peak above those live before, the
    /// first call's seconds and the other calls'.
    fn run<C>(
        &self,
        mut cache: C,
        mut next: impl FnMut(Tensor<2, Int>, &mut C) -> Tensor<2>,
    ) -> Result<(u64, [f64; 2]), Box<dyn std::error::Error>> {
        let Self {
            prompt,
            tokens,
            device,
            meter,
        } = *self;
        let mut sequence: Vec<i64> = prompt.iter().map(|&token| token as i64).collect();
        let mut stdout = std::io::stdout().lock();
        let live = meter.live_bytes();
        meter.reset_peak();
        let mut seconds = [0.0; 2];
        for step in 0..tokens {
            let start = Instant::now();
            let len = sequence.len();
            let input = Tensor::from_data(TensorData::new(sequence.clone(), [1, len]), device);
            // The padding token is no byte: the next token is the likeliest byte. Reading it back
            // waits for the call's work.
            let bytes = next(input, &mut cache).narrow(1, 0, ByteTokenizer::PAD_TOKEN);
            let byte = bytes.argmax(1).into_scalar::<i64>();
            seconds[usize::from(step > 0)] += start.elapsed().as_secs_f64();
            sequence.push(byte);
            stdout.write_all(&[byte as u8])?;
            stdout.flush()?;
        }
        writeln!(stdout)?;
        Ok((meter.peak_bytes().saturating_sub(live), seconds))
    }
}

/// A warm-up step (it makes the optimizer state), then the measured one, on the text's first
/// batch, calling what the `Learner` calls: `TrainStep::step`, then `TrainStep::optimize`.
fn measure(run: &Run, device: &Device) -> Result<StepMeasurement, Box<dyn std::error::Error>> {
    let config = run.config();
    config.check_variant(run.model)?;
    let text = load_text(run.text.as_deref())?;
    let items = text_items(&text, config.max_seq_length + 1);
    if items.len() < config.batch_size {
        return Err(format!("the text fills {} items, fewer than a batch", items.len()).into());
    }
    let batch = (0..config.batch_size)
        .map(|index| items.get(index))
        .collect::<Result<Vec<_>, _>>()?;
    let batcher = TextGenerationBatcher::new(ByteTokenizer, config.max_seq_length);
    let autodiff = device.clone().autodiff();
    autodiff.seed(config.seed);
    let batch = batcher.batch(batch, &autodiff);
    let mut optimizer = config.optimizer.init();
    let meter = MemoryMeter::new(device);
    let seq = batch.tokens_inputs.dims()[1];
    let (peak_bytes, step_seconds) = match run.model {
        Variant::Burn => {
            let model = config.model().init(&autodiff);
            measure_steps(model, &mut optimizer, &batch, &meter)
        }
        Variant::Memwall => {
            let model = config.memwall_model().init(&autodiff);
            measure_steps(model, &mut optimizer, &batch, &meter)
        }
    }?;
    Ok(StepMeasurement {
        model: run.model,
        device: burn_memwall::device::describe(device),
        seq,
        batch: config.batch_size,
        peak_bytes,
        step_seconds,
    })
}

/// Bytes above the live ones at the peak of the second of two steps, and its time.
fn measure_steps<M>(
    model: M,
    optimizer: &mut ModuleOptimizer,
    batch: &TrainingTextGenerationBatch,
    meter: &MemoryMeter,
) -> Result<(u64, f64), Box<dyn std::error::Error>>
where
    M: TrainStep<Input = TrainingTextGenerationBatch> + burn::module::Module,
{
    let device = batch.tokens_inputs.device();
    let learning_rate = ModuleLearningRate::from(1e-4);
    let mut step = |model: M| {
        let output = model.step(batch.clone());
        let model = model.optimize(optimizer, learning_rate.clone(), output.grads);
        drop(output.item);
        model
    };
    let model = step(model);
    device.sync()?;
    let live = meter.live_bytes();
    meter.reset_peak();
    let start = Instant::now();
    let model = step(model);
    device.sync()?;
    let seconds = start.elapsed().as_secs_f64();
    let peak = meter.peak_bytes().saturating_sub(live);
    drop(model);
    Ok((peak, seconds))
}
