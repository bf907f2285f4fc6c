//! What every benchmark shares: one child process per measurement, and the timed loop.
#![allow(dead_code)] // each benchmark uses a different part of this module

use std::process::Command;
use std::time::Instant;

use burn::prelude::*;
use burn_memwall::memory::MemoryMeter;
use clap::Args;
use serde::Serialize;
use serde::de::DeserializeOwned;

const ROW_PREFIX: &str = "bench-row ";

/// The options every benchmark takes (`#[command(flatten)]` into its own).
#[derive(Args, Debug)]
pub struct RunArgs {
    #[arg(long, env = "BURN_DEVICE", default_value = "flex")]
    pub device: String,
    /// Timed repeats after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the measured rows as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Internal: measure one job in this process.
    #[arg(long, hide = true)]
    pub worker: Option<String>,
    /// cargo bench passes this through.
    #[arg(long, hide = true)]
    pub bench: bool,
}

impl RunArgs {
    /// Writes `rows` as pretty JSON to `--json`, when given.
    pub fn write_json<R: Serialize>(&self, rows: &[R]) -> Result<(), Box<dyn std::error::Error>> {
        if let Some(path) = &self.json {
            std::fs::write(path, serde_json::to_string_pretty(rows)? + "\n")?;
        }
        Ok(())
    }
}

/// Prints a worker's measured row for [`run_worker`] to find.
pub fn report<R: Serialize>(row: &R) -> Result<(), serde_json::Error> {
    println!("{ROW_PREFIX}{}", serde_json::to_string(row)?);
    Ok(())
}

/// The row of `job`, measured by this benchmark in a child process started with
/// `--worker job` (so no measurement inherits another's allocator state or device pools), or
/// why it has none: the last line of the child's error output.
pub fn run_worker<R: DeserializeOwned>(job: &str) -> Result<R, String> {
    let output = std::env::current_exe()
        .and_then(|exe| {
            Command::new(exe)
                .args(std::env::args().skip(1).filter(|a| a != "--bench"))
                .args(["--worker", job])
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

/// The rows of `jobs` that ran, each measured by [`run_worker`]; for each that did not, a line
/// that says why.
pub fn run_workers<R: DeserializeOwned>(jobs: &[&str]) -> Vec<R> {
    jobs.iter()
        .filter_map(|job| match run_worker::<R>(job) {
            Ok(row) => Some(row),
            Err(error) => {
                println!("{job:<16} does not run: {error}");
                None
            }
        })
        .collect()
}

/// Peak bytes above what was live before the timed runs, and their median time.
pub struct Measured {
    pub peak_bytes: u64,
    pub median_s: f64,
}

/// Runs `step` (forward + backward, returning one gradient) once to warm up, then `repeats`
/// times, each timed until the device has finished every kernel. Fails when the device could
/// not run the step: wgpu reports work it skipped (a buffer past the adapter's binding limit)
/// only when a result is read back, so the last gradient is read and must be nonzero.
pub fn measure_op_step<const D: usize>(
    device: &Device,
    repeats: usize,
    mut step: impl FnMut() -> Tensor<D>,
) -> Result<Measured, Box<dyn std::error::Error>> {
    let meter = MemoryMeter::new(device);
    step(); // what the runtime allocates once is not the op's
    let before = meter.live_bytes();
    let mut peak_bytes = 0;
    let mut times = Vec::new();
    let mut grad = None;
    for _ in 0..repeats.max(1) {
        drop(grad.take()); // the previous step's gradient is not part of this step's peak
        meter.reset_peak();
        let started = Instant::now();
        grad = Some(step());
        device.sync()?; // reading one gradient does not wait for every kernel of the step
        times.push(started.elapsed().as_secs_f64());
        peak_bytes = peak_bytes.max(meter.peak_bytes().saturating_sub(before));
    }
    let magnitude = grad
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
        return Err(format!("the device returned no gradient (Σ|grad| = {magnitude})").into());
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured {
        peak_bytes,
        median_s: times[times.len() / 2],
    })
}
