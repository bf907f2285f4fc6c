//! Forward + backward of flash attention (tiled on Flex, CubeCL kernels on Cube), and of its
//! blockwise path on the backend's own matmuls, beside Burn's autodiff attention, in one run:
//! peak bytes above the inputs, median time and useful TFLOP/s, per sequence length.
//!
//! ```text
//! cargo bench --bench flash_attention -- [--device flex|wgpu] [--seqs 512,1024,...] [--repeats 3] [--mask] [--dropout P]
//!     [--paths flash,blockwise,burn] [--score-tile-mib 64] [--json out.json]
//! ```
//!
//! Causal attention, declared as an option; with `--mask`, given to both paths as a `[1, s, s]`
//! boolean mask instead (made before the measured step, as a caller's mask is). With
//! `--dropout P`, the attention weights are dropped out: flash attention's own dropout, and on
//! Burn's side what Burn's `MultiHeadAttention` does (scores, softmax, `Dropout`, matmul), since
//! Burn's fused `attention` has no dropout.
//!
//! Each (path, length) runs in its own child process, so no measurement inherits another's
//! allocator state or device pools.

mod common;

use burn::nn::DropoutConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::softmax;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall::ops::flash_attention::{
    AttentionDropout, FlashAttentionOptions, blockwise_attention, flash_attention,
};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: common::RunArgs,
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096,8192")]
    seqs: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    d: usize,
    /// Causality as a boolean mask rather than an option.
    #[arg(long)]
    mask: bool,
    /// Dropout probability of the attention weights.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// `flash` (the backend op: CubeCL kernels on Cube, tiled on Flex), `blockwise` (the tiled
    /// algorithm on the backend's own matmuls, `blockwise_attention`), `burn`.
    #[arg(long, value_delimiter = ',', default_value = "flash,burn")]
    paths: Vec<String>,
    /// The blockwise path's score tile, in MiB.
    #[arg(long, default_value_t = 64)]
    score_tile_mib: usize,
}

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    path: String,
    device: String,
    seq: usize,
    heads: usize,
    d: usize,
    masked: bool,
    dropout: f64,
    peak_bytes: u64,
    median_s: f64,
    /// Useful TFLOP/s: causal attention's `3.5 · 4·s²·d·heads / 2` (forward, and a backward of
    /// 2.5 forwards) over the median time, as FlashAttention counts, the same for both paths.
    tflops: f64,
    /// What the flash kernels ask of this device at this shape (`flash` rows of builds with a
    /// Cube runtime; on Flex, of a desktop GPU's limits).
    launch_plan: Option<serde_json::Value>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(job) = &args.run.worker {
        let (path, seq) = job.split_once(':').ok_or("worker job is path:seq")?;
        common::report(&measure(&args, path, seq.parse()?)?)?;
        return Ok(());
    }
    let mut rows = Vec::new();
    println!(
        "{:<16} {:>6} {:<10} {:>12} {:>10} {:>8} {:>14} {:>10}",
        "device", "seq", "path", "peak", "median s", "TFLOP/s", "burn peak ÷", "÷ burn s"
    );
    for &seq in &args.seqs {
        let measured: Vec<(String, Result<Row, String>)> = args
            .paths
            .iter()
            .map(|path| {
                (
                    path.clone(),
                    common::run_worker::<Row>(&format!("{path}:{seq}")),
                )
            })
            .collect();
        let burn = measured
            .iter()
            .find_map(|(path, row)| row.as_ref().ok().filter(|_| path == "burn"));
        for (path, row) in &measured {
            match row {
                Ok(row) => {
                    let (peak, time) = burn.map_or((f64::NAN, f64::NAN), |burn| {
                        (
                            burn.peak_bytes as f64 / row.peak_bytes as f64,
                            row.median_s / burn.median_s,
                        )
                    });
                    println!(
                        "{:<16} {:>6} {:<10} {:>12} {:>10.3} {:>8.2} {:>14.1} {:>10.2}",
                        row.device,
                        seq,
                        path,
                        human_bytes(row.peak_bytes),
                        row.median_s,
                        row.tflops,
                        peak,
                        time
                    )
                }
                Err(error) => println!("{:<16} {:>6} {path:<10} does not run: {error}", "", seq),
            }
        }
        rows.extend(measured.into_iter().filter_map(|(_, row)| row.ok()));
    }
    args.run.write_json(&rows)
}

/// Causal forward + backward of one path (by option or mask): the highest peak and the median
/// time.
fn measure(args: &Args, path: &str, seq: usize) -> Result<Row, Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.run.device))?.device()?;
    let shape = [1, args.heads, seq, args.d];
    let random =
        |device: &Device| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let autodiff = device.clone().autodiff();
    let [q, k, v, d_out] = [(); 4].map(|_| random(&autodiff));
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    if !["flash", "blockwise", "burn"].contains(&path) {
        return Err(format!("unknown path {path}").into());
    }
    let mask = args.mask.then(|| {
        let mask = Tensor::<2, Bool>::tril_mask([seq, seq], 0, &autodiff).unsqueeze_dim::<3>(0);
        mask.to_data(); // made now, not lazily inside the measured step
        mask
    });
    let burn_dropout = DropoutConfig::new(args.dropout).init();
    let flash_options = FlashAttentionOptions {
        causal: mask.is_none(),
        dropout: Some(AttentionDropout {
            prob: args.dropout,
            seed: 1,
        }),
        ..Default::default()
    };
    let attend = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| match path {
        "flash" => flash_attention(q, k, v, mask.clone(), flash_options),
        "blockwise" => blockwise_attention(
            q,
            k,
            v,
            mask.clone(),
            flash_options,
            args.score_tile_mib << 20,
        ),
        _ if args.dropout > 0.0 => {
            // Burn's `MultiHeadAttention::forward`, on the same causal mask.
            let hidden = mask.clone().unwrap_or_else(|| {
                Tensor::<2, Bool>::tril_mask([seq, seq], 0, &q.device()).unsqueeze_dim::<3>(0)
            });
            let scores = q.matmul(k.transpose()) / (args.d as f64).sqrt();
            let scores = scores.mask_fill(hidden.unsqueeze_dim::<4>(1), f32::NEG_INFINITY);
            burn_dropout.forward(softmax(scores, 3)).matmul(v)
        }
        _ => attention(
            q,
            k,
            v,
            mask.clone()
                .map(|mask| mask.unsqueeze_dim::<4>(1).expand([1, args.heads, seq, seq])),
            None,
            AttentionModuleOptions {
                is_causal: mask.is_none(),
                ..Default::default()
            },
        ),
    };
    let step = || {
        let grads = (attend(q.clone(), k.clone(), v.clone()) * d_out.clone())
            .sum()
            .backward();
        q.grad(&grads).expect("q is tracked")
    };
    let measured = common::measure_op_step(&device, args.run.repeats, step)?;
    Ok(Row {
        path: path.to_owned(),
        device: describe(&device),
        seq,
        heads: args.heads,
        d: args.d,
        masked: args.mask,
        dropout: args.dropout,
        peak_bytes: measured.peak_bytes,
        median_s: measured.median_s,
        tflops: 3.5 * 2.0 * (seq * seq * args.d * args.heads) as f64 / measured.median_s / 1e12,
        launch_plan: (path == "flash")
            .then(|| launch_plan(shape, args.mask, &device))
            .flatten(),
    })
}

/// The flash kernels' launch plans at these shapes on `device`, as JSON.
#[cfg(feature = "cube")]
fn launch_plan(shape: [usize; 4], masked: bool, device: &Device) -> Option<serde_json::Value> {
    use burn::tensor::DType;
    use burn_memwall::ops::flash_attention::{AttentionShapes, LaunchPlan, launch_plans};
    let shapes = AttentionShapes {
        q: shape,
        k: shape,
        v: shape,
    };
    let plans = launch_plans(&shapes, masked, DType::F32, device).ok()?;
    let kernel = |plan: LaunchPlan| {
        serde_json::json!({
            "live_f32_per_unit": plan.live_f32_per_unit,
            "units_per_cube": plan.units_per_cube,
            "shared_bytes": plan.shared_bytes,
            "cubes": plan.cubes,
            "fma_per_global_load": plan.fma_per_global_load,
            "global_bytes_per_flop": plan.global_bytes_per_flop,
        })
    };
    Some(serde_json::json!({
        "limits": match plans.on_device {
            true => "device",
            false => "desktop GPU (48 KiB shared, 1024 units)",
        },
        "forward": kernel(plans.forward),
        "query_grad": kernel(plans.query_grad),
        "key_grad": kernel(plans.key_grad),
    }))
}

#[cfg(not(feature = "cube"))]
fn launch_plan(_: [usize; 4], _: bool, _: &Device) -> Option<serde_json::Value> {
    None
}
