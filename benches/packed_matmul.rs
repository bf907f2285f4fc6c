//! Both products of a linear (`x · Wᵀ` and `dy · W`) with a packed weight, beside Burn's matmul
//! with the same weight dense in f32:
//!
//! - `counter`: the 6-bit counter-synapse code of a `CounterLinear` (0.75 byte per weight);
//! - `ternary`: the 2-bit export of a `TernaryLinear` (0.25 byte per weight);
//! - `dense`: Burn's matmul on the f32 weight (4 bytes per weight).
//!
//! On a Cube device the packed products decode inside the GEMM; on Flex they decode a block of
//! rows at a time for Flex's matmul.
//!
//! ```text
//! cargo bench --bench packed_matmul -- [--device flex|wgpu] [--tokens 512] [--d-input 384] [--d-output 1536] [--repeats 5] [--json out.json]
//! ```
//!
//! `weight` is what the weight holds; `peak` is above the weight and the inputs. Each path runs
//! in its own child process.

mod common;

use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use burn_memwall::DeviceChoice;
use burn_memwall::codes::PackedLayout;
use burn_memwall::codes::counter::CounterCode;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall::nn::PackedWeight;
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const PATHS: [&str; 3] = ["counter", "ternary", "dense"];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    /// Rows of `x` and `dy`.
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    #[arg(long, default_value_t = 384)]
    d_input: usize,
    #[arg(long, default_value_t = 1536)]
    d_output: usize,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    weight_bytes: u64,
    peak_bytes: u64,
    median_s: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(path) = &args.run.worker {
        common::report(&measure(&args, path)?)?;
        return Ok(());
    }
    println!(
        "{:<8} {:<16} {:>10} {:>10} {:>10} {:>10}",
        "path", "device", "weight", "peak", "median ms", "÷ dense"
    );
    let rows: Vec<Row> = common::run_workers(&PATHS);
    let dense = rows.iter().find(|r| r.path == "dense").map(|r| r.median_s);
    for row in &rows {
        println!(
            "{:<8} {:<16} {:>10} {:>10} {:>10.3} {:>10.2}",
            row.path,
            row.device,
            human_bytes(row.weight_bytes),
            human_bytes(row.peak_bytes),
            row.median_s * 1e3,
            dense.map_or(f64::NAN, |d| row.median_s / d)
        );
    }
    args.run.write_json(&rows)
}

fn measure(args: &Args, path: &str) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let (d_input, d_output) = (args.d_input, args.d_output);
    let x = Tensor::<2>::random([args.tokens, d_input], Distribution::Default, &device);
    let dy = Tensor::<2>::random([args.tokens, d_output], Distribution::Default, &device);
    let layout = match path {
        "counter" => PackedLayout::Counter(CounterCode::new(11)?),
        "ternary" => PackedLayout::Ternary,
        "dense" => {
            let weight = Tensor::<2>::random([d_output, d_input], Distribution::Default, &device);
            let measured = common::measure_op_step(&device, args.run.repeats, || {
                let y = x.clone().matmul(weight.clone().transpose());
                let dx = dy.clone().matmul(weight.clone());
                y.slice([0..1, 0..1]) + dx.slice([0..1, 0..1])
            })?;
            return Ok(row(path, &device, 4 * d_input * d_output, measured));
        }
        other => return Err(format!("unknown path {other}; expected one of {PATHS:?}").into()),
    };
    // Random words: the products' cost does not depend on the codes' values.
    let width = layout.words_per_row(d_input);
    let codes = Tensor::<2, Int>::random(
        [d_output, width],
        Distribution::Uniform(0.0, i32::MAX as f64),
        &device,
    )
    .cast(DType::U32);
    let weight = PackedWeight {
        layout,
        d_input,
        codes,
        scale: Tensor::ones([d_output], &device) * 0.02,
    };
    let measured = common::measure_op_step(&device, args.run.repeats, || {
        let y = weight.matmul(x.clone());
        let dx = weight.matmul_transposed(dy.clone());
        y.slice([0..1, 0..1]) + dx.slice([0..1, 0..1])
    })?;
    Ok(row(path, &device, 4 * d_output * (width + 1), measured))
}

fn row(path: &str, device: &Device, weight_bytes: usize, measured: common::Measured) -> Row {
    Row {
        path: path.to_owned(),
        device: describe(device),
        weight_bytes: weight_bytes as u64,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
    }
}
