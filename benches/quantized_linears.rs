//! Learning with quantised block linears: the reference LM trained through the Learner with
//! dense linears + AdamW, ternary linears (BitNet QAT) + AdamW, and counter linears (their own
//! update in backward; AdamW for the embedding, norms and head), on the same tokens, steps and
//! seed. Prints the validation loss of each beside the dense one, and the training speed.
//!
//! ```text
//! cargo bench --bench quantized_linears -- [--data ../shared/data/tinyshakespeare.txt] [--model small] [--seq 128] [--batch 8] [--steps 300] [--lr 3e-3] [--json out.json]
//! ```
//!
//! Every run trains with `InBackward` (the same AdamW updates as the standard step), so that
//! the counter's step follows the learning rate like the optimizer's. Byte-level tokens (the
//! vocabulary is 256 whatever the preset's). Each run is a child process.

mod common;

use std::path::PathBuf;

use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::CountingAllocator;
use burn_memwall_models::data::{Corpus, TextTokenizer, load_text};
use burn_memwall_models::lm::{LinearKind, LmConfig};
use burn_memwall_models::training::{
    Artifacts, RunConfig, Start, StepOptimizer, TrainingConfig, train,
};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const KINDS: [(&str, LinearKind); 3] = [
    ("dense", LinearKind::Dense),
    ("ternary", LinearKind::Ternary),
    ("counter", LinearKind::Counter),
];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    /// UTF-8 text (default: the corpus embedded in the library).
    #[arg(long)]
    data: Option<PathBuf>,
    #[arg(long, default_value = "small")]
    model: String,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Training steps (one epoch).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    linear: String,
    device: String,
    model: String,
    steps: usize,
    tokens_per_step: usize,
    train_loss: f64,
    valid_loss: f64,
    tokens_per_s: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(kind) = &args.run.worker {
        common::report(&measure(&args, kind)?)?;
        return Ok(());
    }
    let mut rows = Vec::new();
    println!(
        "{:<9} {:<8} {:>7} {:>11} {:>11} {:>14} {:>10}",
        "linear", "device", "steps", "train loss", "valid loss", "valid ÷ dense", "tokens/s"
    );
    for (name, _) in KINDS {
        match common::run_worker::<Row>(name) {
            Ok(row) => rows.push(row),
            Err(error) => println!("{name:<9} does not run: {error}"),
        }
        let dense = rows
            .iter()
            .find(|r| r.linear == "dense")
            .map(|r| r.valid_loss);
        if let Some(row) = rows.last().filter(|r| r.linear == name) {
            println!(
                "{:<9} {:<8} {:>7} {:>11.4} {:>11.4} {:>14.4} {:>10.0}",
                row.linear,
                row.device,
                row.steps,
                row.train_loss,
                row.valid_loss,
                dense.map_or(f64::NAN, |d| row.valid_loss / d),
                row.tokens_per_s
            );
        }
    }
    args.run.write_json(&rows)
}

fn measure(args: &Args, name: &str) -> Result<Row, Box<dyn std::error::Error>> {
    let (_, linear) = KINDS
        .iter()
        .find(|(kind, _)| *kind == name)
        .ok_or_else(|| format!("unknown linear {name}"))?;
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let corpus = Corpus::new(
        TextTokenizer::byte_level(),
        &load_text(args.data.as_deref())?,
        0.1,
    )?;
    let mut model = LmConfig::preset(&args.model)?.with_linear(*linear);
    model.vocab_size = corpus.tokenizer().vocab_size();
    let training = TrainingConfig::new()
        .with_seq_len(args.seq)
        .with_batch_size(args.batch)
        .with_epochs(1)
        .with_max_steps_per_epoch(Some(args.steps))
        .with_learning_rate(args.lr)
        .with_optimizer(StepOptimizer::InBackwardAdamW)
        .with_seed(args.seed);
    let dir = tempfile::tempdir()?;
    let report = train(
        &RunConfig::new(model, training),
        &corpus,
        &device,
        &Artifacts::new(dir.path()),
        &Start::Fresh,
        true,
    )?;
    let epoch = report.epochs.last().ok_or("no epoch trained")?;
    Ok(Row {
        linear: name.to_owned(),
        device: describe(&device),
        model: args.model.clone(),
        steps: args.steps,
        tokens_per_step: args.seq * args.batch,
        train_loss: epoch.train_loss,
        valid_loss: epoch.valid_loss,
        tokens_per_s: epoch.train_tokens_per_s,
    })
}
