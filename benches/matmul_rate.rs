//! The rate of a square f32 matmul through Burn (autotuned where the build has `autotune`):
//! the measured peak that the flash kernels' useful FLOPs are compared against.
//!
//! ```text
//! cargo bench --bench matmul_rate -- [--device flex|wgpu] [--sizes 4096,8192] [--repeats 5] [--json out.json]
//! ```

mod common;

use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use clap::Parser;
use serde::Serialize;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    #[arg(long, value_delimiter = ',', default_value = "4096,8192")]
    sizes: Vec<usize>,
}

#[derive(Serialize, Debug)]
struct Row {
    device: String,
    n: usize,
    median_s: f64,
    /// `2 n³` floating-point operations per second, in TFLOP/s.
    tflops: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let mut rows = Vec::new();
    println!(
        "{:<20} {:>6} {:>10} {:>8}",
        "device", "n", "median s", "TFLOP/s"
    );
    for &n in &args.sizes {
        let [a, b] = [0; 2].map(|_| Tensor::<2>::random([n, n], Distribution::Default, &device));
        // The first product compiles and tunes; it is not timed.
        a.clone().matmul(b.clone()).into_data();
        let mut times: Vec<f64> = (0..args.run.repeats.max(1))
            .map(|_| {
                let started = Instant::now();
                let product = a.clone().matmul(b.clone());
                device.sync().expect("the device runs the product");
                drop(product);
                started.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let median_s = times[times.len() / 2];
        let row = Row {
            device: describe(&device),
            n,
            median_s,
            tflops: 2.0 * (n as f64).powi(3) / median_s / 1e12,
        };
        println!(
            "{:<20} {:>6} {:>10.4} {:>8.2}",
            row.device, row.n, row.median_s, row.tflops
        );
        rows.push(row);
        // Each size as it is measured: a larger one may not fit.
        args.run.write_json(&rows)?;
    }
    Ok(())
}
