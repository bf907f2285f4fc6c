//! Forward + backward of each saving op beside Burn's own form of it, in one run: what the
//! forward keeps for backward beyond its output, the step's peak bytes above the inputs and its
//! median time, at `[tokens, width]`.
//!
//! ```text
//! cargo bench --bench savers -- [--device flex|wgpu] [--tokens 4096] [--d-model 768] [--d-ff 2048] [--repeats 5] [--json out.json]
//! ```
//!
//! - `rms_norm` (`[tokens, d_model]`, the scale trained) beside `burn::nn::RmsNorm`;
//! - `swiglu` (`[tokens, d_ff]` twice) beside `silu(a) * b`;
//! - `swiglu_linear` (down to `d_model`, the weight trained) beside `linear(silu(a) * b, W)`;
//! - `relu_squared_linear` beside `linear(relu(u)², W)`;
//! - `rotary` (`[tokens / 1024, 1024, d_model]` as `[batch, seq, heads · 64]`) beside
//!   `RotaryEncoding::apply` on the heads split first, as a model calls it.
//!
//! Every input is tracked, as in a model, and the step's loss is `Σ y · w` with `w` trained, so
//! that, as in a model, the output's reader keeps the output: the peak is the op's forward, what
//! it keeps beside that, and its backward. Each (op, path) runs in its
//! own child process, so no measurement inherits another's allocator state or device pools.

mod common;

use burn::nn::{RmsNormConfig, RotaryEncodingConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::{relu, silu};
use burn::tensor::module::linear;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, MemoryMeter, human_bytes};
use burn_memwall::ops::relu_squared::relu_squared_linear;
use burn_memwall::ops::rms_norm::rms_norm;
use burn_memwall::ops::rotary::rotary;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::ops::swiglu::{swiglu, swiglu_linear};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const OPS: [&str; 5] = [
    "rms_norm",
    "swiglu",
    "swiglu_linear",
    "relu_squared_linear",
    "rotary",
];

/// The rotary rows' sequence length and head width.
const ROTARY_SEQ: usize = 1024;
const ROTARY_HEAD: usize = 64;
const PATHS: [&str; 2] = ["burn", "ours"];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    #[arg(long, default_value_t = 768)]
    d_model: usize,
    #[arg(long, default_value_t = 2048)]
    d_ff: usize,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    op: String,
    path: String,
    device: String,
    tokens: usize,
    kept_bytes: u64,
    peak_bytes: u64,
    median_s: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(job) = &args.run.worker {
        let (op, path) = job.split_once(':').ok_or("worker job is op:path")?;
        common::report(&measure(&args, op, path)?)?;
        return Ok(());
    }
    println!(
        "{:<16} {:<20} {:<6} {:>12} {:>12} {:>10} {:>8} {:>8}",
        "device", "op", "path", "kept", "peak", "median s", "peak ×", "time ×"
    );
    let mut rows = Vec::new();
    for op in OPS {
        let jobs: Vec<String> = PATHS.iter().map(|path| format!("{op}:{path}")).collect();
        let jobs: Vec<&str> = jobs.iter().map(String::as_str).collect();
        let measured: Vec<Row> = common::run_workers(&jobs);
        // Ratios are Burn's over ours: how many times less memory, and the time ours takes.
        let burn = measured.iter().find(|row| row.path == "burn");
        for row in &measured {
            let (peak, time) = burn.map_or((f64::NAN, f64::NAN), |burn| {
                (
                    burn.peak_bytes as f64 / row.peak_bytes as f64,
                    row.median_s / burn.median_s,
                )
            });
            println!(
                "{:<16} {:<20} {:<6} {:>12} {:>12} {:>10.4} {:>8.2} {:>8.2}",
                row.device,
                row.op,
                row.path,
                human_bytes(row.kept_bytes),
                human_bytes(row.peak_bytes),
                row.median_s,
                peak,
                time
            );
        }
        rows.extend(measured);
    }
    args.run.write_json(&rows)
}

/// Forward + backward of `op` by `path`: the highest peak and the median time.
fn measure(args: &Args, op: &str, path: &str) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let autodiff = device.clone().autodiff();
    let ours = match path {
        "ours" => true,
        "burn" => false,
        other => return Err(format!("unknown path {other}; expected one of {PATHS:?}").into()),
    };
    let (tokens, d, d_ff) = (args.tokens, args.d_model, args.d_ff);
    let tracked = |shape: [usize; 2], std: f64| {
        Tensor::<2>::random(shape, Distribution::Normal(0.0, std), &autodiff).require_grad()
    };
    let (a, b) = (tracked([tokens, d_ff], 1.0), tracked([tokens, d_ff], 1.0));
    let weight = tracked([d_ff, d], (d_ff as f64).sqrt().recip());
    let norm = RmsNormConfig::new(d).init(&autodiff);
    let x = tracked([tokens, d], 1.0);
    let rope = RotaryEncodingConfig::new(ROTARY_SEQ, ROTARY_HEAD).init(&autodiff);
    let batch = tokens / ROTARY_SEQ;
    let rows = |t: Tensor<2>| t.reshape([batch, ROTARY_SEQ, d]);
    let heads = d / ROTARY_HEAD;
    let forward: Box<dyn Fn() -> Tensor<2>> = match (op, ours) {
        ("rms_norm", true) => Box::new(|| rms_norm(x.clone(), norm.gamma.val(), norm.epsilon)),
        ("rms_norm", false) => Box::new(|| norm.forward(x.clone())),
        ("swiglu", true) => Box::new(|| swiglu(a.clone(), b.clone())),
        ("swiglu", false) => Box::new(|| silu(a.clone()) * b.clone()),
        ("swiglu_linear", true) => Box::new(|| {
            swiglu_linear(
                a.clone(),
                b.clone(),
                weight.clone(),
                None,
                SavedPrecision::Full,
            )
        }),
        ("swiglu_linear", false) => {
            Box::new(|| linear(silu(a.clone()) * b.clone(), weight.clone(), None))
        }
        ("relu_squared_linear", true) => {
            Box::new(|| relu_squared_linear(a.clone(), weight.clone(), None, SavedPrecision::Full))
        }
        ("relu_squared_linear", false) => {
            Box::new(|| linear(relu(a.clone()).powi_scalar(2), weight.clone(), None))
        }
        ("rotary", true) => Box::new(|| rotary(rows(x.clone()), &rope, 0).reshape([tokens, d])),
        ("rotary", false) => Box::new(|| {
            let split = rows(x.clone())
                .reshape([batch, ROTARY_SEQ, heads, ROTARY_HEAD])
                .swap_dims(1, 2);
            rope.apply(split, 0).swap_dims(1, 2).reshape([tokens, d])
        }),
        (other, _) => return Err(format!("unknown op {other}; expected one of {OPS:?}").into()),
    };
    let output_weights =
        Tensor::<2>::random(forward().dims(), Distribution::Default, &autodiff).require_grad();
    let input = match op {
        "rms_norm" | "rotary" => x.clone(),
        _ => a.clone(),
    };
    let step = || {
        let grads = (forward() * output_weights.clone()).sum().backward();
        input.grad(&grads).expect("the input is tracked")
    };
    let measured = common::measure_op_step(&device, args.run.repeats, step)?;
    // What the graph holds after the forward pass beyond the output (f32).
    let meter = MemoryMeter::new(&device);
    let before = meter.live_bytes();
    let y = forward();
    device.sync()?;
    let output_bytes = 4 * y.shape().num_elements() as u64;
    let kept_bytes = meter.live_bytes().saturating_sub(before + output_bytes);
    drop(y);
    Ok(Row {
        op: op.to_owned(),
        path: path.to_owned(),
        device: describe(&device),
        tokens,
        kept_bytes,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
    })
}
