//! Peak memory of a training step, one row per stack, for the same model, data and seed.
//!
//! ```text
//! cargo run --release --example memgate -- --model small --seq 256 --batch 4 --steps 5 --json out.json
//! ```
//!
//! Each stack runs in its own child process so that no stack inherits another's allocator state
//! or pool peaks. The named stacks of `train --stack` come first (`baseline`: Burn's attention,
//! full logits + `CrossEntropyLoss` and AdamW after backward; `memwall`, `memwall-sgd`,
//! `memwall-counter`); then each row of [`PARTS`] changes one part or combines several, so that
//! each burn-memwall part has its own row. A stack that runs out of memory is reported as a row
//! that does not fit, and the others still run. Beside each measured peak stands the memory
//! budget's prediction (`lm::step_budget`) and their ratio, where the budget models the stack
//! and the device (Flex, dense linears). `host optim` is the optimizer state kept in host
//! memory (`memwall-offload`, `memwall-host-update` with its f32 masters, or any stack with
//! `--offload`), computed from the state's formula; the other columns are the device's.

use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::budget::DeviceMemory;
use burn_memwall::memory::{CountingAllocator, human_bytes};
use burn_memwall::optim::{HostOffload, InactiveState};
use burn_memwall_models::data::{TextTokenizer, load_text};
use burn_memwall_models::lm::{LmConfig, LoraConfig, human_count, parameter_census, step_budget};
use burn_memwall_models::training::{
    RunConfig, TrainingConfig, every_stack, find_stack, measure_training_steps,
};
use clap::Parser;

#[path = "cli/pipe.rs"]
mod pipe;
#[path = "cli/weights.rs"]
mod weights;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use weights::WeightArgs;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Marks the line a child process reports its row on.
const ROW_PREFIX: &str = "memgate-row ";
/// How a worker says that its stack's run is refused (e.g. LoRA on counter-coded linears).
const REFUSED_PREFIX: &str = "memgate-refused ";

#[derive(Parser, Debug, Clone)]
#[command(about = "Measure the peak memory of a training step for each burn-memwall stack")]
struct Args {
    /// tiny, small, gpt2-124m or llama-1b (with its own vocabulary).
    #[arg(long, default_value = "small")]
    model: String,
    /// auto, flex, wgpu, vulkan, metal, webgpu, cuda, rocm or cpu.
    #[arg(long, env = "BURN_DEVICE", default_value = "auto")]
    device: String,
    #[arg(long, default_value_t = 256)]
    seq: usize,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Training steps per stack (the first is a warm-up and is not timed).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// UTF-8 text to draw the batches from (default: the embedded corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Override the preset's tying of the LM head to the embedding (`--tie-embeddings false`
    /// gives the head its own weight).
    #[arg(long)]
    tie_embeddings: Option<bool>,
    /// The weights' precision and LoRA (adapters' alpha: 2 × rank).
    #[command(flatten)]
    weights: WeightArgs,
    /// Steps per block for the stacks that train one block at a time (default: the stack's,
    /// 50). A block's optimizer state is made at its first step's update, so its second step is
    /// its steady state: with 2, `--steps` of twice the blocks and one more measure every block.
    #[arg(long)]
    switch_every: Option<usize>,
    /// For the stacks that train one block at a time: keep each block's optimizer state for
    /// its next turn instead of dropping it.
    #[arg(long)]
    keep_block_state: bool,
    /// For the stacks that train one block at a time: keep the weights of the blocks not
    /// training in host memory (the row is named `STACK+weights-on-host`); devices with memory
    /// of their own only.
    #[arg(long)]
    weights_on_host: bool,
    /// Keep every stack's optimizer state in host memory: `state` (the default) between
    /// updates (its row is named `STACK+offload`), `update` with the update on the host too
    /// (`STACK+host-update`); devices with memory of their own only.
    #[arg(long, num_args = 0..=1, default_missing_value = "state")]
    offload: Option<HostOffload>,
    /// Stacks to run (default: all).
    #[arg(long, value_delimiter = ',')]
    stacks: Vec<String>,
    /// Write the rows as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw each stack's pools at the peak as a stacked bar (SVG) here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Internal: run one stack in this process and print its row.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct Row {
    stack: String,
    device: String,
    model: String,
    parameters: usize,
    seq: usize,
    batch: usize,
    steps: usize,
    /// `F32`, or bf16 with its update of the weights.
    precision: String,
    /// The rank of the LoRA adapters, when only they train.
    lora_rank: Option<usize>,
    peak_bytes: u64,
    persistent_bytes: u64,
    parameter_bytes: u64,
    optimizer_state_bytes: u64,
    /// The optimizer state kept in host memory between updates (computed: the state's formula
    /// for every trained parameter; 0 where the state stays on the device; not computed for one
    /// block at a time with the state dropped, whose host holds one block's).
    host_state_bytes: Option<u64>,
    gradient_bytes: u64,
    activation_and_workspace_bytes: u64,
    /// What the forward pass left alive for backward (measured).
    saved_activation_bytes: u64,
    /// The budget's prediction of `peak_bytes`, where it models the stack and the device.
    predicted_peak_bytes: Option<u64>,
    tokens_per_s: f64,
    loss: f32,
}

fn main() {
    pipe::end_quietly_when_the_reader_leaves();
    let args = Args::parse();
    let result = match &args.worker {
        Some(stack) => run_stack(&args, stack).map(|row| {
            println!(
                "{ROW_PREFIX}{}",
                serde_json::to_string(&row).expect("rows serialise")
            );
        }),
        None => run_all(&args),
    };
    match result {
        Ok(()) => {}
        Err(error) => match error.downcast_ref::<burn_memwall_models::Error>() {
            Some(burn_memwall_models::Error::InvalidConfig(why)) if args.worker.is_some() => {
                println!("{REFUSED_PREFIX}{why}")
            }
            _ => {
                eprintln!("error: {error}");
                std::process::exit(1);
            }
        },
    }
}

fn run_all(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let stacks: Vec<String> = if args.stacks.is_empty() {
        every_stack().iter().map(|s| s.name.to_string()).collect()
    } else {
        args.stacks.clone()
    };
    for name in &stacks {
        find_stack(name)?;
    }
    let (mut rows, mut unfit) = (Vec::new(), Vec::new());
    for stack in &stacks {
        eprintln!("running stack `{stack}` ...");
        let output = Command::new(std::env::current_exe()?)
            .args(std::env::args().skip(1))
            .args(["--worker", stack])
            .output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let row = stdout
            .lines()
            .find_map(|line| line.strip_prefix(ROW_PREFIX));
        if let Some(why) = stdout
            .lines()
            .find_map(|line| line.strip_prefix(REFUSED_PREFIX))
        {
            eprintln!("stack `{stack}` skipped: {why}");
            continue;
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        match (output.status.success(), row) {
            (true, Some(row)) => rows.push(serde_json::from_str::<Row>(row)?),
            // The allocator aborts the child: the stack needs more than the machine (or the
            // `prlimit` it runs under) gives.
            _ => match stderr.lines().find(|l| l.contains("memory allocation of")) {
                Some(line) => {
                    eprintln!("stack `{stack}` does not fit: {line}");
                    unfit.push(Unfit {
                        stack: stack.clone(),
                        reason: line.trim().to_owned(),
                    });
                }
                None => {
                    let first_lines: Vec<&str> = stderr.lines().take(12).collect();
                    let lines = first_lines.join("\n");
                    return Err(format!("stack `{stack}` failed:\n{lines}").into());
                }
            },
        }
    }
    print_table(&rows, &unfit);
    if let Some(path) = &args.plot {
        plot_pools(&rows, &unfit, path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.json {
        let report = Report { rows, unfit };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// A stack whose step ran out of memory.
#[derive(Serialize, Debug)]
struct Unfit {
    stack: String,
    /// The allocator's message.
    reason: String,
}

/// What `--json` writes.
#[derive(Serialize, Debug)]
struct Report {
    rows: Vec<Row>,
    unfit: Vec<Unfit>,
}

fn print_table(rows: &[Row], unfit: &[Unfit]) {
    println!(
        "{:<24} {:<22} {:>12} {:>12} {:>6} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>8}",
        "stack",
        "device",
        "peak",
        "predicted",
        "ratio",
        "persistent",
        "params",
        "optim",
        "host optim",
        "grads",
        "acts+work",
        "fwd saved",
        "tokens/s",
        "loss"
    );
    for r in rows {
        let (predicted, ratio) = match r.predicted_peak_bytes {
            Some(bytes) => (
                human_bytes(bytes),
                format!("{:.3}", bytes as f64 / r.peak_bytes as f64),
            ),
            None => ("-".to_owned(), "-".to_owned()),
        };
        println!(
            "{:<24} {:<22} {:>12} {:>12} {:>6} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10.0} {:>8.4}",
            r.stack,
            r.device,
            human_bytes(r.peak_bytes),
            predicted,
            ratio,
            human_bytes(r.persistent_bytes),
            human_bytes(r.parameter_bytes),
            human_bytes(r.optimizer_state_bytes),
            r.host_state_bytes.map_or("-".to_owned(), human_bytes),
            human_bytes(r.gradient_bytes),
            human_bytes(r.activation_and_workspace_bytes),
            human_bytes(r.saved_activation_bytes),
            r.tokens_per_s,
            r.loss
        );
    }
    for u in unfit {
        println!("{:<24} does not fit: {}", u.stack, u.reason);
    }
    if let Some(r) = rows.first() {
        let lora = match r.lora_rank {
            Some(rank) => format!(", LoRA rank {rank}"),
            None => String::new(),
        };
        println!(
            "model {} ({} parameters), seq {}, batch {}, {} steps, {}{lora}",
            r.model,
            human_count(r.parameters),
            r.seq,
            r.batch,
            r.steps,
            r.precision
        );
    }
}

/// Measures `args.steps` training steps of `stack` in this process.
fn run_stack(args: &Args, name: &str) -> Result<Row, Box<dyn std::error::Error>> {
    let stack = find_stack(name)?;
    let precision = args.weights.precision()?;
    let device = DeviceChoice::from_arg_or_env(Some(&args.device))?.device_in(precision.dtype())?;
    let mut config = LmConfig::preset(&args.model)?;
    let mut switches = stack.switches;
    let optimizer = switches.apply(&mut config);
    if let (Some(schedule), Some(switch_every)) =
        (&mut switches.block_coordinate, args.switch_every)
    {
        schedule.switch_every = switch_every;
    }
    if let (Some(schedule), true) = (&mut switches.block_coordinate, args.keep_block_state) {
        schedule.inactive_state = InactiveState::Kept;
    }
    let mut name = match args.offload {
        Some(offload) if switches.host_offload != Some(offload) => match offload {
            HostOffload::State => format!("{name}+offload"),
            HostOffload::Update => format!("{name}+host-update"),
        },
        _ => name.to_owned(),
    };
    if let (Some(schedule), true) = (&mut switches.block_coordinate, args.weights_on_host) {
        schedule.weights_on_host = true;
        name.push_str("+weights-on-host");
    }
    switches.host_offload = args.offload.or(switches.host_offload);
    if let Some(tie) = args.tie_embeddings {
        config.tie_embeddings = tie;
    }
    // Byte ids fit every preset's vocabulary, so all models train on the same data.
    let tokens = TextTokenizer::byte_level().encode(&load_text(args.data.as_deref())?)?;
    let windows: Vec<Vec<u32>> = tokens
        .chunks_exact(args.seq + 1)
        .map(<[u32]>::to_vec)
        .collect();
    let lora = args
        .weights
        .lora
        .map(|rank| LoraConfig::new(rank, 2.0 * rank as f64));
    let training = TrainingConfig::new()
        .with_seq_len(args.seq)
        .with_batch_size(args.batch)
        .with_learning_rate(args.lr)
        .with_optimizer(optimizer)
        .with_block_coordinate(switches.block_coordinate)
        .with_host_offload(switches.host_offload)
        .with_precision(precision)
        .with_seed(args.seed)
        .with_lora(lora);
    let measured = measure_training_steps(
        &RunConfig::new(config.clone(), training),
        &windows,
        args.steps,
        &device,
    )?;
    let pools = measured.pools;
    let shape = args.weights.step_shape(precision, args.batch, args.seq);
    let plan = switches.optimizer_plan(precision.half_update());
    // None where the budget does not model the stack on this device.
    let predicted_peak_bytes = step_budget(&config, &plan, shape, DeviceMemory::of(&device))
        .ok()
        .map(|budget| budget.peak());
    let host_state_bytes =
        plan.host_bytes(&parameter_census(&config, shape.float, shape.lora_rank));
    Ok(Row {
        stack: name,
        device: describe(&device),
        model: args.model.clone(),
        parameters: config.param_count(),
        seq: args.seq,
        batch: args.batch,
        steps: args.steps,
        precision: format!("{precision:?}"),
        lora_rank: args.weights.lora,
        peak_bytes: pools.peak,
        persistent_bytes: pools.persistent(),
        parameter_bytes: pools.parameters,
        optimizer_state_bytes: pools.optimizer_state,
        host_state_bytes,
        gradient_bytes: pools.gradients,
        activation_and_workspace_bytes: pools.activations_and_workspace,
        saved_activation_bytes: measured.saved_activations,
        predicted_peak_bytes,
        tokens_per_s: measured.tokens_per_s,
        loss: measured.loss,
    })
}

/// The pools of [`plot_pools`], bottom to top, with their colours.
const POOLS: [(&str, (u8, u8, u8)); 4] = [
    ("parameters", (66, 110, 180)),
    ("optimizer state", (230, 150, 50)),
    ("gradients", (200, 70, 70)),
    ("activations + workspace", (110, 170, 90)),
];

/// A row's bytes in each of [`POOLS`].
fn pool_bytes(row: &Row) -> [u64; 4] {
    [
        row.parameter_bytes,
        row.optimizer_state_bytes,
        row.gradient_bytes,
        row.activation_and_workspace_bytes,
    ]
}

/// The pools at each stack's peak as stacked bars, one per row, with the stacks that do not fit
/// named beneath.
fn plot_pools(
    rows: &[Row],
    unfit: &[Unfit],
    path: &Path,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    const GIB: f64 = (1u64 << 30) as f64;
    const HEIGHT: u32 = 520;
    let tallest = rows.iter().map(|r| r.peak_bytes).max().unwrap_or(1) as f64 / GIB;
    let width = (200 + 110 * rows.len() as u32).max(640);
    let root = SVGBackend::new(path, (width, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = match rows.first() {
        Some(r) => format!(
            "{} ({} parameters), seq {}, batch {}: pools at a training step's peak",
            r.model,
            human_count(r.parameters),
            r.seq,
            r.batch
        ),
        None => "no stack fit".to_owned(),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40 + 16 * unfit.len() as u32)
        .y_label_area_size(60)
        // One segment per row: a segmented `0..n` has n + 1 segments.
        .build_cartesian_2d(
            (0..rows.len().max(1) - 1).into_segmented(),
            0.0..tallest * 1.3,
        )?;
    let names: Vec<String> = rows.iter().map(|r| r.stack.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|segment| match segment {
            SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("GiB")
        .draw()?;
    for (k, (name, (r, g, b))) in POOLS.into_iter().enumerate() {
        let color = RGBColor(r, g, b);
        let bars = rows.iter().enumerate().map(|(i, row)| {
            let bytes = pool_bytes(row);
            let below: u64 = bytes[..k].iter().sum();
            let (bottom, top) = (below as f64 / GIB, (below + bytes[k]) as f64 / GIB);
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i), bottom),
                    (SegmentValue::Exact(i + 1), top),
                ],
                color.filled(),
            );
            bar.set_margin(0, 0, 14, 14);
            bar
        });
        chart
            .draw_series(bars)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    for (k, u) in unfit.iter().enumerate() {
        let y = (HEIGHT - 16 * (unfit.len() - k) as u32) as i32;
        root.draw(&Text::new(
            format!("{}: does not fit ({})", u.stack, u.reason),
            (12, y),
            ("sans-serif", 13),
        ))?;
    }
    root.present()?;
    Ok(())
}
