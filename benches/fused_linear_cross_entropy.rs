//! Forward + backward of the fused linear + cross-entropy beside Burn's path (the logits
//! `hidden · weightᵀ`, as `Linear` computes them, then `CrossEntropyLoss`), in one run: peak
//! bytes above the inputs and median time, per (vocab, tokens).
//!
//! ```text
//! cargo bench --bench fused_linear_cross_entropy -- [--device flex|wgpu] [--vocabs 32000,50257,128256]
//!     [--tokens 1024,4096,8192] [--d 512] [--paths fused,recompute,burn,counter,counter-logits] [--chunk TOKENS]
//!     [--vocab-slices N] [--repeats 3] [--json out.json]
//! ```
//!
//! Paths: `fused` (gradients during the forward pass, the default), `recompute` (gradients
//! recomputed in the backward pass from a saved log-sum-exp) and `burn`. Two more have a head
//! whose weight is a 6-bit counter code (`CounterLinear`, updated in its own backward):
//! `counter` walks the vocabulary in blocks (`try_forward_counter`), `counter-logits` forms the
//! full logits with the layer's forward and takes Burn's loss. Each (path, vocab, tokens) runs
//! in its own child process.

mod common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall::nn::GradientPass;
use burn_memwall::nn::{CounterLinearConfig, FusedLinearCrossEntropyLossConfig};
use burn_memwall::ops::fused_linear_cross_entropy::{
    FusedCrossEntropyOptions, fused_linear_cross_entropy,
};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    #[arg(long, value_delimiter = ',', default_value = "32000,50257,128256")]
    vocabs: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,8192")]
    tokens: Vec<usize>,
    #[arg(long, default_value_t = 512)]
    d: usize,
    #[arg(long, value_delimiter = ',', default_value = "fused,burn")]
    paths: Vec<String>,
    /// Tokens per chunk of the fused paths (default: the op's own choice).
    #[arg(long)]
    chunk: Option<usize>,
    /// Slices of the vocabulary in the hidden gradient's product (default: the op's choice).
    #[arg(long)]
    vocab_slices: Option<usize>,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    vocab: usize,
    tokens: usize,
    d: usize,
    peak_bytes: u64,
    median_s: f64,
    /// The fused paths' chunks and the output tiles of their products.
    launch_plan: Option<serde_json::Value>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(job) = &args.run.worker {
        let mut parts = job.split(':');
        let (Some(path), Some(vocab), Some(tokens)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err("worker job is path:vocab:tokens".into());
        };
        common::report(&measure(&args, path, vocab.parse()?, tokens.parse()?)?)?;
        return Ok(());
    }
    println!(
        "{:<14} {:>7} {:>7} {:<10} {:>12} {:>10} {:>14} {:>10}",
        "device", "vocab", "tokens", "path", "peak", "median s", "burn peak ÷", "÷ burn s"
    );
    let mut rows = Vec::new();
    for &vocab in &args.vocabs {
        for &tokens in &args.tokens {
            let measured: Vec<(&String, Result<Row, String>)> = args
                .paths
                .iter()
                .map(|path| {
                    let row = common::run_worker::<Row>(&format!("{path}:{vocab}:{tokens}"));
                    (path, row)
                })
                .collect();
            let burn = measured
                .iter()
                .find_map(|(path, row)| row.as_ref().ok().filter(|_| *path == "burn"));
            for (path, row) in &measured {
                match row {
                    Ok(row) => println!(
                        "{:<14} {:>7} {:>7} {:<10} {:>12} {:>10.3} {:>14} {:>10}",
                        row.device,
                        vocab,
                        tokens,
                        path,
                        human_bytes(row.peak_bytes),
                        row.median_s,
                        burn.map_or("—".into(), |b| format!(
                            "{:.1}",
                            b.peak_bytes as f64 / row.peak_bytes as f64
                        )),
                        burn.map_or("—".into(), |b| format!(
                            "{:.2}",
                            row.median_s / b.median_s
                        )),
                    ),
                    Err(error) => {
                        println!(
                            "{:<14} {vocab:>7} {tokens:>7} {path:<10} does not run: {error}",
                            ""
                        )
                    }
                }
            }
            rows.extend(measured.into_iter().filter_map(|(_, row)| row.ok()));
        }
    }
    args.run.write_json(&rows)
}

/// Mean loss, forward + backward, of one path: the highest peak and the median time.
fn measure(
    args: &Args,
    path: &str,
    vocab: usize,
    tokens: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let autodiff = device.clone().autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    let hidden = Tensor::<2>::random([tokens, args.d], normal, &autodiff).require_grad();
    let weight = (Tensor::<2>::random([vocab, args.d], normal, &autodiff) / (args.d as f64).sqrt())
        .require_grad();
    let targets = Tensor::<1, Int>::random(
        [tokens],
        Distribution::Uniform(0.0, vocab as f64),
        &autodiff,
    );
    if path.starts_with("counter") {
        let head = CounterLinearConfig::new(args.d, vocab)
            .with_bias(false)
            .init(&autodiff);
        let fused = match path {
            "counter" => true,
            "counter-logits" => false,
            other => return Err(format!("unknown path {other}").into()),
        };
        let step = || {
            let loss = if fused {
                FusedLinearCrossEntropyLossConfig::new()
                    .init()
                    .try_forward_counter(hidden.clone(), &head.weights, targets.clone(), None)
                    .expect("valid shapes and targets")
            } else {
                CrossEntropyLossConfig::new()
                    .init(&autodiff)
                    .forward(head.forward(hidden.clone()), targets.clone())
            };
            hidden
                .grad(&loss.backward())
                .expect("the hidden states are tracked")
        };
        let measured = common::measure_op_step(&device, args.run.repeats, step)?;
        return Ok(row(path, &device, vocab, tokens, args, measured));
    }
    let gradients = match path {
        "fused" => Some(GradientPass::DuringForward),
        "recompute" => Some(GradientPass::Recompute),
        "burn" => None,
        other => return Err(format!("unknown path {other}").into()),
    };
    let step = || {
        let loss = match gradients {
            Some(gradients) => fused_linear_cross_entropy(
                hidden.clone(),
                weight.clone(),
                None,
                targets.clone(),
                options(args, gradients),
            ),
            None => CrossEntropyLossConfig::new().init(&autodiff).forward(
                hidden.clone().matmul(weight.clone().transpose()),
                targets.clone(),
            ),
        };
        weight
            .grad(&loss.backward())
            .expect("the weight is tracked")
    };
    let measured = common::measure_op_step(&device, args.run.repeats, step)?;
    Ok(row(path, &device, vocab, tokens, args, measured))
}

fn row(
    path: &str,
    device: &Device,
    vocab: usize,
    tokens: usize,
    args: &Args,
    measured: common::Measured,
) -> Row {
    Row {
        path: path.to_owned(),
        device: describe(device),
        vocab,
        tokens,
        d: args.d,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
        launch_plan: ["fused", "recompute"].contains(&path).then(|| {
            let plan = options(args, GradientPass::DuringForward).chunk_plan(tokens, vocab, args.d);
            serde_json::json!({
                "chunk_tokens": plan.chunk_tokens,
                "chunks": plan.chunks,
                "vocab_slices": plan.vocab_slices,
                "logits_tiles": plan.logits_tiles,
                "hidden_grad_tiles": plan.hidden_grad_tiles,
                "weight_grad_tiles": plan.weight_grad_tiles,
                "weight_grad_adds": plan.weight_grad_adds,
            })
        }),
    }
}

/// The fused paths' options: the gradient pass, and the chunk and slices asked for.
fn options(args: &Args, gradients: GradientPass) -> FusedCrossEntropyOptions {
    FusedCrossEntropyOptions {
        gradients,
        chunk_size: args.chunk,
        vocab_slices: args.vocab_slices,
        ..Default::default()
    }
}
