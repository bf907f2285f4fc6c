//! Forward + backward of a stack of the reference LM's blocks at growing depth, fixed width and
//! tokens: reversible couplings (`ReversibleSequence`), the same couplings as plain autodiff ops,
//! and the plain ones under Burn's `BalancedCheckpointing`, in one run: peak bytes above the
//! parameters and input, and median time, per depth. The parameters are frozen unless
//! `--trained`: their gradients would grow with depth in all three paths alike, and the peak
//! measured here is the activations'. Frozen, a backward pass costs about one forward pass, so
//! the reversible path's extra forward weighs more than in training; `--trained` measures that
//! case (its peak then includes the parameters' gradients).
//!
//! ```text
//! cargo bench --bench reversible -- [--device flex|wgpu] [--depths 8,32,128] [--width 256] [--seq 256] [--batch 4] [--trained] [--repeats 3] [--json out.json]
//! ```
//!
//! Each (path, depth) runs in its own child process, so no measurement inherits another's
//! allocator state or device pools.

mod common;

use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall_models::lm::{AttentionKind, BlockKind, LmConfig, reversible_blocks};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const PATHS: [&str; 3] = ["reversible", "plain", "checkpointed"];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
    depths: Vec<usize>,
    /// Width of each of the two streams (the model's `d_model`).
    #[arg(long, default_value_t = 256)]
    width: usize,
    #[arg(long, default_value_t = 256)]
    seq: usize,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Attention of `F`: burn or flash.
    #[arg(long, default_value = "flash")]
    attention: String,
    /// Train the parameters (compute their gradients) instead of freezing them.
    #[arg(long)]
    trained: bool,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    depth: usize,
    width: usize,
    tokens: usize,
    peak_bytes: u64,
    median_s: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(job) = &args.run.worker {
        let (path, depth) = job.split_once(':').ok_or("worker job is path:depth")?;
        common::report(&measure(&args, path, depth.parse()?)?)?;
        return Ok(());
    }
    let mut rows = Vec::new();
    println!(
        "{:<16} {:>6} {:<14} {:>12} {:>10} {:>12} {:>10}",
        "device", "depth", "path", "peak", "median s", "peak ×", "time ×"
    );
    for &depth in &args.depths {
        let measured: Vec<(&str, Result<Row, String>)> = PATHS
            .iter()
            .map(|path| (*path, common::run_worker::<Row>(&format!("{path}:{depth}"))))
            .collect();
        // Ratios are against the plain stack of the same depth.
        let plain = measured
            .iter()
            .find_map(|(path, row)| (*path == "plain").then_some(row.as_ref().ok()).flatten())
            .map(|row| (row.peak_bytes, row.median_s));
        for (path, row) in &measured {
            match row {
                Ok(row) => {
                    let (peak_ratio, time_ratio) = plain.map_or((f64::NAN, f64::NAN), |(p, t)| {
                        (p as f64 / row.peak_bytes as f64, row.median_s / t)
                    });
                    println!(
                        "{:<16} {:>6} {:<14} {:>12} {:>10.3} {:>12.2} {:>10.2}",
                        row.device,
                        depth,
                        path,
                        human_bytes(row.peak_bytes),
                        row.median_s,
                        peak_ratio,
                        time_ratio
                    );
                }
                Err(error) => println!("{:<16} {:>6} {path:<14} does not run: {error}", "", depth),
            }
        }
        rows.extend(measured.into_iter().filter_map(|(_, row)| row.ok()));
    }
    args.run.write_json(&rows)
}

/// Forward + backward of one path at `depth`: the highest peak and the median time.
fn measure(args: &Args, path: &str, depth: usize) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let autodiff = match path {
        "checkpointed" => device.clone().autodiff().gradient_checkpointing(),
        "reversible" | "plain" => device.clone().autodiff(),
        other => return Err(format!("unknown path {other}; expected one of {PATHS:?}").into()),
    };
    let config = LmConfig::new(256, args.width, depth, 4, 4, 2 * args.width, args.seq)
        .with_blocks(BlockKind::Reversible)
        .with_attention(match args.attention.as_str() {
            "burn" => AttentionKind::Burn,
            "flash" => AttentionKind::Flash,
            other => return Err(format!("unknown attention {other}").into()),
        });
    config.validate()?;
    let stack = reversible_blocks(&config, &autodiff);
    let stack = if args.trained { stack } else { stack.no_grad() };
    // Two streams of the model's width.
    let shape = [args.batch, args.seq, 2 * args.width];
    let x = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &autodiff).require_grad();
    let weights = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &autodiff);
    let reversible = path == "reversible";
    let step = || {
        let y = if reversible {
            stack.forward(x.clone())
        } else {
            stack.forward_plain(x.clone())
        };
        let grads = (y * weights.clone()).sum().backward();
        x.grad(&grads).expect("x is tracked")
    };
    let measured = common::measure_op_step(&device, args.run.repeats, step)?;
    Ok(Row {
        path: path.to_owned(),
        device: describe(&device),
        depth,
        width: args.width,
        tokens: args.batch * args.seq,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
    })
}
