//! The update of one `[rows, cols]` layer from a given weight gradient, side by side:
//!
//! - `counter-fused`: the counter synapse's update as one op (CubeCL kernel / Flex pass) on the
//!   packed 6-bit code, in place;
//! - `counter-unfused`: the same arithmetic as separate tensor ops on unpacked `(t, c)` in f32
//!   (8 bytes per weight instead of 0.75, and no packing), each op making a temporary the size
//!   of the layer, as a framework without the fused op would run it;
//! - `adamw` and `fused-adamw`: what a dense layer's update costs instead (Burn's `AdamW`, and
//!   burn-memwall's in-place `FusedAdamW`), on an f32 weight of the same shape;
//! - `adamw8` and `adamw4`: burn-memwall's `LowBitAdamW`, its moments in 8 or 4 bits.
//!
//! ```text
//! cargo bench --bench counter_update -- [--device flex|wgpu] [--rows 1536] [--cols 384] [--repeats 5] [--json out.json]
//! ```
//!
//! Peak is above the state and the gradient; each path runs in its own child process.

mod common;

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::DeviceChoice;
use burn_memwall::codes::counter::{
    CounterCode, CounterHyper, bias_correction, set_code, words_per_row,
};
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall::nn::HostWeights;
use burn_memwall::ops::counter_linear::CounterTensors;
use burn_memwall::optim::{FusedAdamWConfig, LowBitAdamWConfig, MomentBits};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const PATHS: [&str; 6] = [
    "counter-fused",
    "counter-unfused",
    "adamw",
    "fused-adamw",
    "adamw8",
    "adamw4",
];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    /// Output rows of the layer.
    #[arg(long, default_value_t = 1536)]
    rows: usize,
    /// Inputs of the layer.
    #[arg(long, default_value_t = 384)]
    cols: usize,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    weights: usize,
    peak_bytes: u64,
    median_s: f64,
}

const HYPER: CounterHyper = CounterHyper {
    learning_rate: 1e-3,
    scale_learning_rate: 1e-4,
    beta: 0.99,
    epsilon: 1e-8,
    seed: 0,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(path) = &args.run.worker {
        common::report(&measure(&args, path)?)?;
        return Ok(());
    }
    println!(
        "{:<16} {:<10} {:>10} {:>12} {:>12} {:>16}",
        "path", "device", "weights", "peak", "median ms", "÷ counter-fused"
    );
    let rows: Vec<Row> = common::run_workers(&PATHS);
    let fused = rows
        .iter()
        .find(|r| r.path == "counter-fused")
        .map(|r| r.median_s);
    for row in &rows {
        println!(
            "{:<16} {:<10} {:>10} {:>12} {:>12.3} {:>16.2}",
            row.path,
            row.device,
            row.weights,
            human_bytes(row.peak_bytes),
            row.median_s * 1e3,
            fused.map_or(f64::NAN, |f| row.median_s / f)
        );
    }
    args.run.write_json(&rows)
}

fn measure(args: &Args, path: &str) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let (rows, cols) = (args.rows, args.cols);
    let gradient = Tensor::<2>::random([rows, cols], Distribution::Normal(0.0, 1e-3), &device);
    let measured = match path {
        "counter-fused" => {
            let code = CounterCode::new(11)?;
            let width = words_per_row(cols);
            let mut words = vec![0u32; rows * width];
            for (k, row) in words.chunks_mut(width).enumerate() {
                for i in 0..cols {
                    set_code(row, i, code.encode((k + i) as i32 % 3 - 1, 0));
                }
            }
            let host = HostWeights {
                code,
                d_input: cols,
                words,
                scale: vec![0.02; rows],
                mean_square: vec![0.0; rows],
            };
            let mut state = CounterTensors::from_host(host, &device);
            let mut step = 0;
            common::measure_op_step(&device, args.run.repeats, || {
                state.update_rows(0..rows, gradient.clone(), &HYPER, step);
                step += 1;
                state.scale.clone()
            })?
        }
        "counter-unfused" => {
            let ternary = || {
                Tensor::<2>::random([rows, cols], Distribution::Uniform(-1.5, 1.5), &device).round()
            };
            let mut state = Unpacked {
                t: ternary(),
                c: ternary() * 3.0,
                scale: Tensor::<2>::ones([rows, 1], &device) * 0.02,
                mean_square: Tensor::<2>::zeros([rows, 1], &device),
            };
            let mut step = 0;
            common::measure_op_step(&device, args.run.repeats, || {
                state = unfused_update(state.clone(), gradient.clone(), step);
                step += 1;
                state.scale.clone()
            })?
        }
        "adamw" | "fused-adamw" | "adamw8" | "adamw4" => {
            let mut optimizer: ModuleOptimizer = match path {
                "adamw" => AdamWConfig::new().init(),
                "fused-adamw" => FusedAdamWConfig::new().init(),
                "adamw8" => LowBitAdamWConfig::new(MomentBits::Eight).init(),
                _ => LowBitAdamWConfig::new(MomentBits::Four).init(),
            };
            // Burn's optimizers step modules that live on an autodiff device.
            let autodiff = device.clone().autodiff();
            let mut layer: Linear = LinearConfig::new(cols, rows)
                .with_bias(false)
                .init(&autodiff);
            layer.weight = Param::from_tensor(Tensor::random(
                [cols, rows],
                Distribution::Normal(0.0, 0.02),
                &autodiff,
            ));
            let gradient = gradient.clone().transpose();
            common::measure_op_step(&device, args.run.repeats, || {
                let mut grads = GradientsParams::new();
                grads.register(layer.weight.id, gradient.clone());
                let stepped = optimizer.step(1e-3, layer.clone(), grads);
                layer = stepped;
                layer.weight.val().inner().slice([0..1, 0..1]).reshape([1])
            })?
        }
        other => return Err(format!("unknown path {other}; expected one of {PATHS:?}").into()),
    };
    Ok(Row {
        path: path.to_owned(),
        device: describe(&device),
        weights: rows * cols,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
    })
}

/// The counter state unpacked to f32: `t`, `c` `[rows, cols]`, scale and statistic `[rows, 1]`.
#[derive(Clone)]
struct Unpacked {
    t: Tensor<2>,
    c: Tensor<2>,
    scale: Tensor<2>,
    mean_square: Tensor<2>,
}

/// `codes::counter::update_row`'s arithmetic as tensor ops over the whole layer.
fn unfused_update(state: Unpacked, gradient: Tensor<2>, step: u32) -> Unpacked {
    let Unpacked {
        t,
        c,
        scale,
        mean_square,
    } = state;
    let [_, cols] = gradient.dims();
    let limit = 11.0f32;
    let wall = limit - 1.0;
    let beta = HYPER.beta;
    let mean_square =
        mean_square * beta + gradient.clone().powi_scalar(2).mean_dim(1) * (1.0 - beta);
    let rms = (mean_square.clone() / bias_correction(beta, step))
        .sqrt()
        .clamp_min(HYPER.epsilon);
    let aligned = (gradient.clone() * t.clone()).sum_dim(1);
    let new_scale = (scale.clone() - aligned * (HYPER.scale_learning_rate / (cols as f32).sqrt()))
        .clamp(1e-5, 10.0);
    let delta = (gradient / rms) * (-HYPER.learning_rate * limit) / new_scale.clone();
    let target = c * scale / new_scale.clone() + delta;
    let floor = target.clone().floor();
    let u = Tensor::<2>::random(target.shape(), Distribution::Default, &target.device());
    let rounded = floor.clone() + u.lower(target - floor).float();
    let carry = (rounded.clone() / limit).int().float();
    let ternary = t + carry.clone();
    let saturated = ternary.clone().abs().greater_elem(1.0);
    let remainder = (rounded.clone() - carry * limit).clamp(-wall, wall);
    let pinned = rounded.sign() * wall;
    Unpacked {
        t: ternary.clamp(-1.0, 1.0),
        c: remainder.mask_where(saturated, pinned),
        scale: new_scale,
        mean_square,
    }
}
