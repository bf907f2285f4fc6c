//! Importing a Llama checkpoint: the bytes held at the peak of `llama::load_llama` beside the
//! model's own parameter bytes (a ratio near 1 means the file's tensors are not held beside
//! the model's), and its time. A random model of the preset's shape is first exported with
//! `llama::save_llama` (SwiGLU, dense, standard blocks: a Llama), and the export's peak is
//! measured the same way.
//!
//! ```text
//! cargo bench --bench llama_import -- [--model small|gpt2-124m|llama-1b] [--json out.json]
//! ```
//!
//! The import runs in a child process on Flex, so it inherits nothing of the export's
//! allocator state.

mod common;

use std::path::PathBuf;
use std::time::Instant;

use burn::prelude::*;
use burn_memwall::memory::{CountingAllocator, MemoryMeter, human_bytes};
use burn_memwall_models::llama::{load_llama, save_llama};
use burn_memwall_models::lm::LmConfig;
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    /// A named size (`train --list-models`).
    #[arg(long, default_value = "small")]
    model: String,
    /// Where the checkpoint is written (a temporary folder without it).
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    /// The model's parameter bytes.
    model_bytes: u64,
    /// Bytes held at the peak of the load above what was live before it.
    peak_bytes: u64,
    seconds: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let dir = match &args.dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("llama-import-{}", args.model)),
    };
    if let Some(job) = &args.run.worker {
        return Ok(common::report(&measure(job, &dir)?)?);
    }
    let device = Device::flex();
    let config = LmConfig::preset(&args.model)?;
    let model = config.init(&device)?;
    let model_bytes = model.num_params() as u64 * 4;
    let meter = MemoryMeter::new(&device);
    let _ = model.clone().map(&mut Drawn); // draws every lazy weight before measuring
    let live = meter.live_bytes();
    meter.reset_peak();
    let start = Instant::now();
    save_llama(&model, &config, &dir)?;
    let export = Row {
        path: "save_llama".into(),
        model_bytes,
        peak_bytes: meter.peak_bytes().saturating_sub(live),
        seconds: start.elapsed().as_secs_f64(),
    };
    drop(model);
    let rows = vec![export, common::run_worker("load_llama")?];
    for row in &rows {
        println!(
            "{} {:<10} model {:>10}  peak {:>10} ({:.2}× the model)  {:.1} s",
            args.model,
            row.path,
            human_bytes(row.model_bytes),
            human_bytes(row.peak_bytes),
            row.peak_bytes as f64 / row.model_bytes as f64,
            row.seconds
        );
    }
    if args.dir.is_none() {
        std::fs::remove_dir_all(&dir)?;
    }
    args.run.write_json(&rows)
}

/// Reads every parameter, so that lazily initialised weights exist.
struct Drawn;

impl burn::module::ModuleMapper for Drawn {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        let _ = param.val();
        param
    }
}

/// The import of the checkpoint in `dir`.
fn measure(path: &str, dir: &std::path::Path) -> Result<Row, Box<dyn std::error::Error>> {
    let device = Device::flex();
    let meter = MemoryMeter::new(&device);
    let live = meter.live_bytes();
    meter.reset_peak();
    let start = Instant::now();
    let model = load_llama(dir, &device)?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(Row {
        path: path.into(),
        model_bytes: model.num_params() as u64 * 4,
        peak_bytes: meter.peak_bytes().saturating_sub(live),
        seconds,
    })
}
