//! A training step (forward + backward) of Burn's `TransformerEncoder` beside the same encoder
//! converted to `FlashTransformerEncoder` (the same parameters), in one run: peak bytes above
//! the inputs and median time, per sequence length.
//!
//! ```text
//! cargo bench --bench transformer_encoder -- [--device flex|wgpu] [--seqs 512,2048] [--d-model 256] [--heads 8] [--layers 2] [--dropout 0.1] [--repeats 3] [--json out.json]
//! ```
//!
//! The input is what Burn's text-generation example gives its encoder: Burn's
//! `generate_autoregressive_mask` as `mask_attn`. Paths: `burn`; `flash-mask`, the converted
//! encoder given the same mask (the one-line swap); `flash-causal`, causality as the option
//! instead. Dropout is the config's (Burn's default 0.1): the residual branches, the
//! feed-forward and the attention weights.
//!
//! Each (path, length) runs in its own child process, so no measurement inherits another's
//! allocator state or device pools.

mod common;

use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall::nn::{FlashTransformerEncoder, FlashTransformerEncoderInput};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const PATHS: [&str; 3] = ["burn", "flash-mask", "flash-causal"];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    seqs: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    seq: usize,
    peak_bytes: u64,
    median_s: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(job) = &args.run.worker {
        let (path, seq) = job.split_once(':').ok_or("worker job is path:seq")?;
        common::report(&measure(&args, path, seq.parse()?)?)?;
        return Ok(());
    }
    println!(
        "{:<14} {:>6} {:<13} {:>12} {:>10} {:>12} {:>12}",
        "device", "seq", "path", "peak", "s", "peak / burn", "time / burn"
    );
    let mut rows = Vec::new();
    for &seq in &args.seqs {
        let jobs: Vec<String> = PATHS.iter().map(|path| format!("{path}:{seq}")).collect();
        let measured: Vec<Result<Row, String>> = jobs
            .iter()
            .map(|job| common::run_worker::<Row>(job))
            .collect();
        let burn = measured[0].as_ref().ok();
        for (path, result) in PATHS.iter().zip(&measured) {
            match (result, burn) {
                (Ok(row), burn) => println!(
                    "{:<14} {:>6} {:<13} {:>12} {:>10.3} {:>12} {:>12}",
                    row.device,
                    seq,
                    path,
                    human_bytes(row.peak_bytes),
                    row.median_s,
                    burn.map_or("-".into(), |b| format!(
                        "{:.3}",
                        row.peak_bytes as f64 / b.peak_bytes as f64
                    )),
                    burn.map_or("-".into(), |b| format!("{:.2}", row.median_s / b.median_s)),
                ),
                (Err(error), _) => println!("{:<14} {seq:>6} {path:<13} does not run: {error}", ""),
            }
        }
        rows.extend(measured.into_iter().flatten());
    }
    args.run.write_json(&rows)
}

/// One training step of `path`'s encoder at `seq` tokens: the highest peak and the median time.
fn measure(args: &Args, path: &str, seq: usize) -> Result<Row, Box<dyn std::error::Error>> {
    if !PATHS.contains(&path) {
        return Err(format!("unknown path {path}").into());
    }
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let autodiff = device.clone().autodiff();
    autodiff.seed(1); // the same parameters on every path
    let config =
        TransformerEncoderConfig::new(args.d_model, 4 * args.d_model, args.heads, args.layers)
            .with_dropout(args.dropout);
    let burn_encoder = config.init(&autodiff);
    let flash = (path != "burn").then(|| FlashTransformerEncoder::from(burn_encoder.clone()));
    let shape = [1, seq, args.d_model];
    let x = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &autodiff).require_grad();
    let d_out = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &autodiff);
    let mask = generate_autoregressive_mask(1, seq, &autodiff);
    mask.to_data(); // made now, not lazily inside the measured step
    let step = || {
        let out = match (&flash, path) {
            (None, _) => burn_encoder
                .forward(TransformerEncoderInput::new(x.clone()).mask_attn(mask.clone())),
            (Some(flash), "flash-mask") => {
                flash.forward(FlashTransformerEncoderInput::new(x.clone()).mask_attn(mask.clone()))
            }
            (Some(flash), _) => {
                flash.forward(FlashTransformerEncoderInput::new(x.clone()).causal())
            }
        };
        let grads = (out * d_out.clone()).sum().backward();
        x.grad(&grads).expect("x is tracked")
    };
    let measured = common::measure_op_step(&device, args.run.repeats, step)?;
    Ok(Row {
        path: path.to_owned(),
        device: describe(&device),
        seq,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
    })
}
