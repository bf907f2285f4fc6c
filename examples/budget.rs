//! Know before the run: the predicted peak of a training step, pool by pool, for every stack,
//! and the stacks that fit in a given memory.
//!
//! ```text
//! cargo run --release --example budget -- --model llama-1b --seq 2048              # every stack's pools
//! cargo run --release --example budget -- --model llama-1b --stack memwall         # one stack, phase by phase
//! cargo run --release --example budget -- --models 0.5b,1b,3b,7b,13b,34b,70b      # peaks by size: f32, bf16 (masters, SR)
//! cargo run --release --example budget -- --fit 6GiB --model llama-1b --seq 4096   # what fits, cheapest first
//! cargo run --release --example budget -- --fit 4GiB --model llama-1b --seq 512 \
//!     --precision bf16 --half-update stochastic-rounding --lora 16                 # a LoRA fine-tune in bf16
//! cargo run --release --example budget -- --model llama-1b --seq 512 --memory cube \
//!     --weights-on-host                            # one block at a time, the others' weights on the host
//! ```
//!
//! Predictions, not measurements: the formulas are those of `burn_memwall_models::lm::step_budget`
//! for Flex's heap or, with `--memory cube`, CubeCL's pools (both checked against measured steps
//! in `tests/budget.rs`, the pools on lavapipe only; half precision and LoRA on Flex only, in
//! `tests/half_precision_training.rs` and `tests/budget.rs`).

use burn_memwall::memory::budget::{DeviceMemory, Pool};
use burn_memwall::memory::{human_bytes, parse_bytes};
use burn_memwall::optim::HalfPrecisionUpdate;
use burn_memwall_models::lm::{LmConfig, LoraConfig, human_count};
use burn_memwall_models::training::{Plan, Precision, every_stack, find_stack};
use clap::{Parser, ValueEnum};

#[path = "cli/pipe.rs"]
mod pipe;
#[path = "cli/weights.rs"]
mod weights;
use weights::WeightArgs;

/// How the device holds a step's tensors.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Memory {
    /// Flex: the process heap.
    Flex,
    /// wgpu, CUDA, ROCm: CubeCL's pools, read as the bytes they reserve.
    Cube,
}

impl Memory {
    fn device_memory(self) -> DeviceMemory {
        match self {
            Self::Flex => DeviceMemory::Heap,
            Self::Cube => DeviceMemory::Pools,
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Predict the peak memory of a training step for each burn-memwall stack")]
struct Args {
    /// A preset (tiny, small, gpt2-124m, llama-1b) or a size (0.5b, 1b, 3b, 7b, 13b, 34b, 70b).
    #[arg(long, default_value = "llama-1b")]
    model: String,
    /// Several models: a table of peaks per stack, in f32 and in bf16 with f32 masters and with
    /// stochastic rounding.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["stack", "fit"])]
    models: Vec<String>,
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[command(flatten)]
    weights: WeightArgs,
    /// How the device holds tensors: `flex` (the heap) or `cube` (wgpu, CUDA, ROCm pools).
    #[arg(long, value_enum, default_value = "flex")]
    memory: Memory,
    /// Print this stack's phases and every term of its peak.
    #[arg(long)]
    stack: Option<String>,
    /// The memory to fit in (e.g. 6GiB, 8GB): the stacks that fit, cheapest in step time first,
    /// with their `train` flags.
    #[arg(long, value_parser = parse_bytes)]
    fit: Option<u64>,
    /// The stacks that train one block at a time keep the waiting blocks' weights in host
    /// memory (`train --weights-on-host`); with `--memory cube` only.
    #[arg(long)]
    weights_on_host: bool,
}

fn main() {
    pipe::end_quietly_when_the_reader_leaves();
    if let Err(error) = run(Args::parse()) {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if !args.models.is_empty() {
        return sizes_table(&args);
    }
    let config = LmConfig::preset(&args.model)?;
    let precision = args.weights.precision()?;
    let plan = plan(&config, &args, precision)?;
    println!(
        "{} ({} parameters), seq {}, batch {}, {precision:?}{}, predicted for {:?}",
        args.model,
        human_count(config.param_count()),
        args.seq,
        args.batch,
        lora_heading(&args.weights),
        args.memory
    );
    if let Memory::Cube = args.memory {
        println!(
            "CubeCL's pools after the first steps, checked on lavapipe: within 6% on tiny and \
             on small, except one block at a time on tiny (8% under), the state in host memory \
             on small (7% under to 8% over) and Burn's optimizers (after backward up to 9% \
             over; in backward up to 7% under); a run can read a page more or less than \
             another with the same seed"
        );
    }
    if let Some(name) = &args.stack {
        let stack = find_stack(name)?.with_weights_on_host(args.weights_on_host);
        let candidate = plan
            .candidates
            .iter()
            .find(|candidate| candidate.stack == stack)
            .ok_or_else(|| format!("the budget does not model `{name}` yet"))?;
        print!("{}", candidate.budget);
        return Ok(());
    }
    match args.fit {
        None => pools_table(&plan),
        Some(available) => fitting(&args, &plan, available)?,
    }
    Ok(())
}

/// Every stack's predicted step of `config` in `precision`, with the shape, adapters and
/// memory of `args`.
fn plan(config: &LmConfig, args: &Args, precision: Precision) -> Result<Plan, String> {
    let shape = args.weights.step_shape(precision, args.batch, args.seq);
    if let Some(rank) = args.weights.lora {
        LoraConfig::new(rank, 2.0 * rank as f64)
            .validate(config)
            .map_err(|error| error.to_string())?;
    }
    if args.weights_on_host && matches!(args.memory, Memory::Flex) {
        return Err(
            "--weights-on-host needs a device with memory of its own (--memory cube): \
                    Flex's memory is the host's"
                .into(),
        );
    }
    let stacks = every_stack()
        .into_iter()
        .map(|stack| stack.with_weights_on_host(args.weights_on_host));
    Plan::of_stacks(
        config,
        shape,
        precision.half_update(),
        args.memory.device_memory(),
        stacks,
    )
    .map_err(|error| error.to_string())
}

/// Every stack's peak and what it is made of.
fn pools_table(plan: &Plan) {
    print!("{:<24} {:>11} {:<20}", "stack", "peak", "at");
    for pool in Pool::ALL {
        print!(" {:>11}", short(pool));
    }
    println!();
    for candidate in &plan.candidates {
        let peak = candidate.budget.peak_phase();
        print!(
            "{:<24} {:>11} {:<20}",
            candidate.stack.name,
            human_bytes(candidate.peak),
            peak.name
        );
        for pool in Pool::ALL {
            print!(" {:>11}", human_bytes(peak.pool(pool)));
        }
        println!();
    }
    not_modelled(plan);
}

/// A pool's name in a narrow column.
fn short(pool: Pool) -> &'static str {
    match pool {
        Pool::Parameters => "params",
        Pool::Buffers => "buffers",
        Pool::OptimizerState => "optim",
        Pool::Gradients => "grads",
        Pool::SavedActivations => "saved",
        Pool::Workspace => "workspace",
        Pool::UpdateTemporaries => "update",
        Pool::Backend => "backend",
    }
}

fn not_modelled(plan: &Plan) {
    if !plan.not_modelled.is_empty() {
        println!(
            "not modelled on this device (or, for an offload on Flex, refused there): {}",
            plan.not_modelled.join(", ")
        );
    }
}

/// The stacks that fit in `available`, cheapest first, with the command that trains each.
fn fitting(args: &Args, plan: &Plan, available: u64) -> Result<(), Box<dyn std::error::Error>> {
    let fitting = plan.fitting(available)?;
    println!(
        "stacks whose predicted peak fits in {}, cheapest in step time first:",
        human_bytes(available)
    );
    println!(
        "{:<24} {:>11} {:>10}  train with",
        "stack", "peak", "step time"
    );
    // The weights' flags as `train` takes them.
    let weights = &args.weights;
    let mut extra = String::new();
    if weights.precision != "f32" {
        extra += &format!(
            " --precision {} --half-update {}",
            weights.precision, weights.half_update
        );
    }
    if let Some(rank) = weights.lora {
        extra += &format!(" --lora {rank}");
    }
    for candidate in fitting {
        let schedule = candidate.stack.switches.block_coordinate;
        let weights_on_host = match schedule.is_some_and(|schedule| schedule.weights_on_host) {
            true => " --weights-on-host",
            false => "",
        };
        println!(
            "{:<24} {:>11} {:>9.2}×  cargo run --release --example train -- --model {} --seq {} \
             --batch {} --stack {}{extra}{weights_on_host}",
            candidate.stack.name,
            human_bytes(candidate.peak),
            candidate.step_time,
            args.model,
            args.seq,
            args.batch,
            candidate.stack.name
        );
    }
    not_modelled(plan);
    Ok(())
}

/// Peaks per stack (rows) and model (columns), once per precision.
fn sizes_table(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let configs = args
        .models
        .iter()
        .map(|name| LmConfig::preset(name))
        .collect::<Result<Vec<_>, _>>()?;
    for precision in [
        Precision::F32,
        Precision::Bf16(HalfPrecisionUpdate::Masters),
        Precision::Bf16(HalfPrecisionUpdate::StochasticRounding),
    ] {
        println!(
            "\npredicted peak, {precision:?}{}, seq {}, batch {}, {:?}",
            lora_heading(&args.weights),
            args.seq,
            args.batch,
            args.memory
        );
        print!("{:<24}", "stack");
        for (name, config) in args.models.iter().zip(&configs) {
            print!(
                " {:>12}",
                format!("{name} ({})", human_count(config.param_count()))
            );
        }
        println!();
        // `None` where the sequence is over the model's context.
        let plans: Vec<Option<Plan>> = configs
            .iter()
            .map(|config| {
                (args.seq <= config.max_seq_len)
                    .then(|| plan(config, args, precision))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        let reference = plans
            .iter()
            .flatten()
            .next()
            .ok_or_else(|| format!("seq {} is over every model's context", args.seq))?;
        for row in &reference.candidates {
            print!("{:<24}", row.stack.name);
            for plan in &plans {
                let cell = match plan {
                    Some(plan) => plan
                        .candidates
                        .iter()
                        .find(|candidate| candidate.stack == row.stack)
                        .map(|candidate| human_bytes(candidate.peak))
                        .unwrap_or_default(),
                    None => "> context".to_owned(),
                };
                print!(" {cell:>12}");
            }
            println!();
        }
    }
    Ok(())
}

/// ", LoRA rank R" when adapters train, for headings.
fn lora_heading(weights: &WeightArgs) -> String {
    match weights.lora {
        Some(rank) => format!(", LoRA rank {rank}"),
        None => String::new(),
    }
}
