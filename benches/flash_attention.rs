//! Forward + backward of flash attention (tiled on Flex, CubeCL kernels on Cube) beside Burn's
//! autodiff attention, in one run: peak bytes above the inputs and median time, per sequence length.
//!
//! ```text
//! cargo bench --bench flash_attention -- [--device flex|wgpu] [--seqs 512,1024,...] [--repeats 3] [--json out.json]
//! ```
//!
//! Each (path, length) runs in its own child process, so no measurement inherits another's
//! allocator state or device pools.

use std::process::Command;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, MemoryMeter, human_bytes};
use burn_memwall::ops::flash_attention::{FlashAttentionOptions, flash_attention};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const ROW_PREFIX: &str = "bench-row ";

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, env = "BURN_DEVICE", default_value = "flex")]
    device: String,
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096,8192")]
    seqs: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    d: usize,
    /// Timed repeats after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: measure one `path:seq` in this process.
    #[arg(long, hide = true)]
    worker: Option<String>,
    /// cargo bench passes this through.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    seq: usize,
    heads: usize,
    d: usize,
    peak_bytes: u64,
    median_s: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(job) = &args.worker {
        let (path, seq) = job.split_once(':').ok_or("worker job is path:seq")?;
        let row = measure(&args, path, seq.parse()?)?;
        println!("{ROW_PREFIX}{}", serde_json::to_string(&row)?);
        return Ok(());
    }
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>6} {:>12} {:>10} {:>12} {:>10} {:>10} {:>10}",
        "device", "seq", "flash peak", "flash s", "burn peak", "burn s", "peak ×", "time ×"
    );
    for &seq in &args.seqs {
        let flash = run_worker("flash", seq);
        let burn = run_worker("burn", seq);
        match (&flash, &burn) {
            (Ok(flash), Ok(burn)) => println!(
                "{:<8} {:>6} {:>12} {:>10.3} {:>12} {:>10.3} {:>10.1} {:>10.2}",
                flash.device,
                seq,
                human_bytes(flash.peak_bytes),
                flash.median_s,
                human_bytes(burn.peak_bytes),
                burn.median_s,
                burn.peak_bytes as f64 / flash.peak_bytes as f64,
                flash.median_s / burn.median_s
            ),
            _ => {
                for (path, result) in [("flash", &flash), ("burn", &burn)] {
                    match result {
                        Ok(row) => println!(
                            "{:<8} {:>6} {path}: {} in {:.3} s",
                            row.device,
                            seq,
                            human_bytes(row.peak_bytes),
                            row.median_s
                        ),
                        Err(error) => println!("{:<8} {:>6} {path} does not run: {error}", "", seq),
                    }
                }
            }
        }
        rows.extend([flash, burn].into_iter().flatten());
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)? + "\n")?;
    }
    Ok(())
}

/// The row of `path` at `seq`, measured in a child process, or why it has none (its last line
/// of error output).
fn run_worker(path: &str, seq: usize) -> Result<Row, String> {
    let output = std::env::current_exe()
        .and_then(|exe| {
            Command::new(exe)
                .args(std::env::args().skip(1).filter(|a| a != "--bench"))
                .args(["--worker", &format!("{path}:{seq}")])
                .output()
        })
        .map_err(|error| error.to_string())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    match stdout
        .lines()
        .find_map(|line| line.strip_prefix(ROW_PREFIX))
    {
        Some(row) if output.status.success() => {
            serde_json::from_str(row).map_err(|e| e.to_string())
        }
        _ => Err(String::from_utf8_lossy(&output.stderr)
            .lines()
            .rfind(|line| !line.trim().is_empty())
            .unwrap_or("no output")
            .to_owned()),
    }
}

/// Causal forward + backward of one path after a warm-up run: the highest peak and the median
/// time of the timed runs.
fn measure(args: &Args, path: &str, seq: usize) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.device))?.device()?;
    let shape = [1, args.heads, seq, args.d];
    let random =
        |device: &Device| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let meter = MemoryMeter::new(&device);
    let autodiff = device.clone().autodiff();
    let [q, k, v, d_out] = [(); 4].map(|_| random(&autodiff));
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let attend: fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4> = match path {
        "flash" => |q, k, v| {
            flash_attention(
                q,
                k,
                v,
                None,
                FlashAttentionOptions {
                    causal: true,
                    ..Default::default()
                },
            )
        },
        "burn" => |q, k, v| {
            attention(
                q,
                k,
                v,
                None,
                None,
                AttentionModuleOptions {
                    is_causal: true,
                    ..Default::default()
                },
            )
        },
        other => return Err(format!("unknown path {other}").into()),
    };
    let step = || {
        let grads = (attend(q.clone(), k.clone(), v.clone()) * d_out.clone())
            .sum()
            .backward();
        q.grad(&grads).expect("q is tracked")
    };
    step(); // warm-up: what the runtime allocates once is not the op's
    let before = meter.live_bytes();
    let mut peak_bytes = 0;
    let mut times = Vec::new();
    let mut dq = None;
    for _ in 0..args.repeats {
        meter.reset_peak();
        let started = Instant::now();
        dq = Some(step());
        device.sync()?; // reading one gradient does not wait for every kernel of the step
        times.push(started.elapsed().as_secs_f64());
        peak_bytes = peak_bytes.max(meter.peak_bytes().saturating_sub(before));
    }
    // wgpu reports work it could not run (a buffer past the adapter's binding limit) only when
    // a result is read back: read one, and check it is a gradient.
    let magnitude = dq
        .expect("at least one timed run")
        .abs()
        .sum()
        .try_into_scalar::<f64>()
        .map_err(|error| {
            let error = format!("{error:?}");
            let error: Vec<&str> = error
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let error: String = error.join(" ").chars().take(240).collect();
            format!("the device failed the step: {error}…")
        })?;
    if !(magnitude.is_finite() && magnitude > 0.0) {
        return Err(format!("the device returned no gradient (Σ|dq| = {magnitude})").into());
    }
    times.sort_by(f64::total_cmp);
    Ok(Row {
        path: path.to_owned(),
        device: describe(&device),
        seq,
        heads: args.heads,
        d: args.d,
        peak_bytes,
        median_s: times[times.len() / 2],
    })
}
