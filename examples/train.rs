//! Train the reference language model through Burn's `Learner`.
//!
//! ```text
//! cargo run --release --example train                       # tiny model, embedded corpus, auto device, the memwall stack
//! cargo run --release --example train -- --stack baseline   # Burn's own path, for comparison
//! cargo run --release --example train -- --model small --seq 512 --fit 300MiB   # the cheapest stack that fits
//! cargo run --release --example train -- --data FILE --tokenizer bpe --vocab 2048 --model small
//! cargo run --release --example train -- --from LLAMA_DIR --lora 16 --data FILE   # fine-tune a checkpoint
//! cargo run --release --example train -- --resume           # continue the run in --artifacts exactly
//! cargo run --release --example train -- --overwrite        # a new run in place of the one in --artifacts
//! ```

use std::path::PathBuf;
use std::time::Instant;

use burn::prelude::Device;
use burn_memwall::DeviceChoice;
use burn_memwall::device::describe;
use burn_memwall::memory::budget::DeviceMemory;
use burn_memwall::memory::{CountingAllocator, MemoryMeter, human_bytes, parse_bytes};
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::optim::{BlockOrder, HostOffload};
use burn_memwall_models::data::{Corpus, TextTokenizer, load_text, split_text};
use burn_memwall_models::lm::{
    AttentionKind, BlockKind, LinearKind, LmConfig, LoraConfig, LossKind, MlpKind, PRESETS,
    SaverKind, human_count,
};
use burn_memwall_models::pretrained::Pretrained;
use burn_memwall_models::training::{
    Artifacts, Candidate, LossCurve, NamedSwitches, Overrides, Plan, Precision, RunConfig,
    ScheduleOverrides, Start, Switches, TrainingConfig, every_stack, find_stack, train,
};
use clap::{Parser, ValueEnum};

#[path = "cli/pipe.rs"]
mod pipe;
#[path = "cli/weights.rs"]
mod weights;
use weights::WeightArgs;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum TokenizerKind {
    /// One token per byte (256 ids).
    Byte,
    /// A byte-level BPE trained on the data (`--vocab` ids).
    Bpe,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum AttentionArg {
    /// Burn's attention op (keeps `[batch, heads, seq, seq]` for the backward pass).
    Burn,
    /// burn-memwall's flash attention (linear memory in the sequence).
    Flash,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum BlocksArg {
    /// Pre-norm residual blocks (every block's activations kept for the backward pass).
    Standard,
    /// Reversible couplings on two full-width streams (the same parameters; activation memory
    /// independent of depth).
    Reversible,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LinearArg {
    /// f32 weights trained by AdamW.
    Dense,
    /// BitNet b1.58 ternary weights, trained through f32 latent weights by AdamW.
    Ternary,
    /// 6-bit counter synapses that update themselves in backward (no weight parameter, no
    /// optimizer state). With an in-backward optimizer their step follows the learning-rate
    /// schedule; without, it is a fixed 1e-3.
    Counter,
    /// `counter` in the blocks, and the embedding and the head as counter codes too: no dense
    /// matrix is left.
    CounterAll,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LossArg {
    /// Full logits, then Burn's `CrossEntropyLoss` (keeps `[tokens, vocab]` for the backward).
    Burn,
    /// burn-memwall's fused linear + cross-entropy (never holds the logits).
    Fused,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum MlpArg {
    /// `down(silu(gate·x) ∘ up·x)`: three matrices (the presets' own).
    Swiglu,
    /// `down(relu(up·x)²)`: two matrices of the same width (GPT-2 sized presets' own).
    Relu2,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum BlockOrderArg {
    /// From the token table up to the head.
    Ascending,
    /// From the head down to the token table (BAdam's default).
    Descending,
    /// A new random order for each pass over the blocks, drawn from `--seed`.
    Random,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum SaversArg {
    /// Burn's autodiff of the composed norm and MLP activation.
    None,
    /// burn-memwall's norm, SwiGLU and ReLU² ops: the same values and gradients, keeping for
    /// the backward pass only what it reads.
    Exact,
    /// `exact`, and in 8 bits per value, rounded stochastically: the MLP activation's inputs
    /// before a dense down projection (SwiGLU's two, ReLU²'s `relu(u)`) and flash attention's
    /// values (the same forward; gradients at the rounded values).
    Int8,
    /// `int8` with the MLP activation's in 4 bits per value (attention's values keep 8).
    Int4,
}

#[derive(Parser, Debug)]
#[command(about = "Train the burn-memwall reference LM through Burn's Learner")]
struct Args {
    /// Model size: tiny, small, gpt2-124m, llama-1b (vocabulary comes from the tokenizer).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// The feed-forward block, in place of the preset's (same width: ReLU² has a third fewer MLP
    /// parameters).
    #[arg(long, value_enum, conflicts_with = "from")]
    mlp: Option<MlpArg>,
    /// Fine-tune a trained model instead of drawing one: a Hugging Face Llama folder or a
    /// folder `train` wrote. Its config and tokenizer are used; the stack's attention, loss and
    /// optimizer apply, its blocks and linears are the model's own. A run from a Llama folder
    /// also exports one (`llama/` in --artifacts).
    #[arg(long, conflicts_with_all = ["model", "tokenizer", "tokenizer_file", "vocab", "fit"])]
    from: Option<PathBuf>,
    /// LoRA's alpha: the adapters' product is scaled by alpha / rank (default 2 × rank).
    #[arg(long, requires = "lora")]
    lora_alpha: Option<f64>,
    /// The set of switches to train with: baseline (Burn's own path), memwall (flash attention,
    /// fused loss, full-width reversible blocks, saving norm and MLP ops, FusedAdamW in backward),
    /// memwall-sgd (SGD in
    /// backward), memwall-counter (every matrix a counter code), memwall-adam8 / memwall-adam4
    /// (AdamW's moments in 8 / 4 bits), memwall-badam (one block of the model at a time, BAdam:
    /// the token table, each layer, the head), or any single-part stack that
    /// memgate measures (flash+fused, all-fused, …). The flags below override single parts.
    #[arg(long, default_value = "memwall")]
    stack: String,
    /// Pick the stack by the memory budget: the cheapest in step time whose predicted peak
    /// fits in this much memory (e.g. 6GiB, 8GB) on the device, or stop with the smallest that
    /// would work. `--switch-every`, `--block-order` and `--weights-on-host` then set the
    /// schedule of a chosen stack that trains one block at a time (the planner counts the
    /// waiting weights in host memory), and turn none on.
    #[arg(long, value_parser = parse_bytes, conflicts_with_all = ["stack", "attention", "blocks", "linear", "loss", "savers", "offload", "keep_block_state"])]
    fit: Option<u64>,
    /// Train one block of the model at a time (BAdam), this many steps each (memwall-badam:
    /// 50); the optimizer then holds one block's state.
    #[arg(long)]
    switch_every: Option<usize>,
    /// The order of the blocks with block-coordinate training (default: descending).
    #[arg(long, value_enum)]
    block_order: Option<BlockOrderArg>,
    /// With block-coordinate training, keep each block's optimizer state for its next turn
    /// instead of dropping it (BAdam's): in host memory with `--offload`, on the device
    /// (no memory saved) without.
    #[arg(long)]
    keep_block_state: bool,
    /// With block-coordinate training, keep the weights of the blocks not training in host
    /// memory (a token table tied to the head stays on the device): each read of one uploads
    /// a copy for as long as the step needs it. Devices with memory of their own; refused on
    /// Flex.
    #[arg(long)]
    weights_on_host: bool,
    /// Keep the optimizer's state in host memory: `state` (the default) between updates, which
    /// run on the device (memwall-offload: the device holds the state of the parameter being
    /// updated only), or `update`, with the update run on the host from an f32 master of each
    /// weight (memwall-host-update: no state on the device). Devices with memory of their own
    /// (wgpu, CUDA, ROCm); refused on Flex.
    #[arg(long, num_args = 0..=1, default_missing_value = "state")]
    offload: Option<HostOffload>,
    /// Attention implementation; both train the same weights.
    #[arg(long, value_enum)]
    attention: Option<AttentionArg>,
    /// Block structure; `reversible` has the same parameters in another architecture.
    #[arg(long, value_enum)]
    blocks: Option<BlocksArg>,
    /// The model's matrices: `ternary` and `counter` the blocks' linears (embedding and head
    /// stay dense), `counter-all` every matrix. The norms stay dense.
    #[arg(long, value_enum)]
    linear: Option<LinearArg>,
    /// Loss implementation; both train the same weights to the same loss.
    #[arg(long, value_enum)]
    loss: Option<LossArg>,
    /// What the norms and the MLP's activation keep for backward: `none` and `exact` train the
    /// same weights to the same loss; `int8` and `int4` the same forward pass, with gradients
    /// read from rounded activations.
    #[arg(long, value_enum)]
    savers: Option<SaversArg>,
    /// auto, flex, wgpu, vulkan, metal, webgpu, cuda, rocm or cpu.
    #[arg(long, env = "BURN_DEVICE", default_value = "auto")]
    device: String,
    /// The weights' precision, and LoRA adapters (exported alone too, adapters.safetensors).
    #[command(flatten)]
    weights: WeightArgs,
    /// UTF-8 text to train on (default: the corpus embedded in the binary).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokenizer to build when no `--tokenizer-file` is given.
    #[arg(long, value_enum, default_value = "byte")]
    tokenizer: TokenizerKind,
    /// An existing Hugging Face `tokenizer.json` to use instead.
    #[arg(long)]
    tokenizer_file: Option<PathBuf>,
    /// BPE vocabulary size (with `--tokenizer bpe`; default 1024).
    #[arg(long)]
    vocab: Option<usize>,
    /// Share of the text, at its end, held out for validation (a BPE is trained on the rest).
    #[arg(long, default_value_t = 0.1)]
    validation_fraction: f64,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Cap on training batches per epoch.
    #[arg(long)]
    steps_per_epoch: Option<usize>,
    /// Cap on validation batches after each epoch.
    #[arg(long)]
    validation_steps: Option<usize>,
    /// Learning rate, after the warm-up and before the decay.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Steps of linear warm-up up to `--lr`.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Steps of cosine decay after the warm-up, from `--lr` down to `--final-lr`, which then
    /// stays.
    #[arg(long, default_value_t = 0)]
    decay: usize,
    #[arg(long, default_value_t = 0.0)]
    final_lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Folder for checkpoints, logs and the exported weights.
    #[arg(long, default_value = "artifacts/train")]
    artifacts: PathBuf,
    /// Continue the run in `--artifacts` from its newest checkpoint that loads, with its own
    /// tokenizer; any changed setting or input is refused.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// With `--resume`: settings that may change on purpose (learning_rate,
    /// final_learning_rate, weight_decay, max_validation_steps, host_offload,
    /// weights_on_host), recorded in run.json.
    #[arg(long, value_delimiter = ',', requires = "resume")]
    allow_change: Vec<String>,
    /// Start a new run in `--artifacts` even if it holds one, deleting that run's files.
    #[arg(long)]
    overwrite: bool,
    /// Print the named model sizes with their parameter counts and exit.
    #[arg(long)]
    list_models: bool,
}

fn main() {
    pipe::end_quietly_when_the_reader_leaves();
    if let Err(error) = run(Args::parse()) {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.list_models {
        return list_models();
    }
    let choice = DeviceChoice::from_arg_or_env(Some(&args.device))?;
    let precision = args.weights.precision()?;
    // SAFETY: only the arguments have been read; no thread has started.
    let device = unsafe { choice.start_as_default_in(precision.dtype()) }?;
    let text = load_text(args.data.as_deref())?;
    let artifacts = Artifacts::new(&args.artifacts);
    if args.vocab.is_some()
        && (args.tokenizer_file.is_some() || matches!(args.tokenizer, TokenizerKind::Byte))
    {
        return Err("--vocab sets the size of a BPE trained here (--tokenizer bpe)".into());
    }
    let base = args.from.as_deref().map(Pretrained::open).transpose()?;
    let base_config = base.as_ref().map(Pretrained::config).transpose()?;
    let tokenizer = match (&args.tokenizer_file, args.tokenizer) {
        // On a resume too: the run then checks that it is the run's own.
        _ if let (Some(base), Some(config)) = (&base, &base_config) => base.tokenizer(config)?,
        (Some(path), _) => TextTokenizer::from_file(path)?,
        // The run's own: a tokenizer built again (a BPE retrained) could give ids other
        // meanings than the weights learned.
        _ if args.resume => {
            println!(
                "tokenizer: the run's own, {}",
                artifacts.tokenizer().display()
            );
            TextTokenizer::from_file(artifacts.tokenizer())?
        }
        (None, TokenizerKind::Byte) => TextTokenizer::byte_level(),
        (None, TokenizerKind::Bpe) => {
            let (training_text, _) = split_text(&text, args.validation_fraction)?;
            TextTokenizer::train_bpe(training_text, args.vocab.unwrap_or(1024))?
        }
    };
    let corpus = Corpus::new(tokenizer, &text, args.validation_fraction)?;
    if corpus.unknown_share() > 0.01 {
        eprintln!(
            "warning: {:.1}% of the tokens are the tokenizer's unknown token",
            100.0 * corpus.unknown_share()
        );
    }
    let mut model = match &base_config {
        Some(config) => config.clone(),
        None => {
            let preset = LmConfig::preset(&args.model)?;
            LmConfig {
                vocab_size: corpus.tokenizer().vocab_size(),
                mlp: match args.mlp {
                    Some(MlpArg::Swiglu) => MlpKind::SwiGlu,
                    Some(MlpArg::Relu2) => MlpKind::ReluSquared,
                    None => preset.mlp,
                },
                ..preset
            }
        }
    };
    let overrides = overrides(&args);
    let (stack, mut switches) = match args.fit {
        None => {
            let stack = find_stack(&args.stack)?;
            (stack, stack.switches.with_overrides(overrides))
        }
        // The schedule flags set the schedule of the stack chosen, if it has one, and turn none
        // on: the run is the stack that the planner counted (the part flags are refused).
        Some(available) => {
            let stack = fit_stack(&model, &args, precision, &device, available)?;
            let switches = Switches {
                block_coordinate: overrides.schedule.set(stack.switches.block_coordinate),
                ..stack.switches
            };
            (stack, switches)
        }
    };
    if let Some(base) = &base_config {
        keep_the_function(&mut switches, base, &args)?;
    }
    let optimizer = switches.apply(&mut model);
    let lora = args.weights.lora.map(|rank| {
        let alpha = args.lora_alpha.unwrap_or(2.0 * rank as f64);
        LoraConfig::new(rank, alpha)
    });
    let training = TrainingConfig::new()
        .with_seq_len(args.seq)
        .with_batch_size(args.batch)
        .with_epochs(args.epochs)
        .with_max_steps_per_epoch(args.steps_per_epoch)
        .with_max_validation_steps(args.validation_steps)
        .with_learning_rate(args.lr)
        .with_warmup_steps(args.warmup)
        .with_decay_steps(args.decay)
        .with_final_learning_rate(args.final_lr)
        .with_optimizer(optimizer)
        .with_block_coordinate(switches.block_coordinate)
        .with_host_offload(switches.host_offload)
        .with_seed(args.seed)
        .with_precision(precision)
        .with_lora(lora.clone());
    // A base's shape is its own, whatever `--model` says (it conflicts with `--from`).
    let model_name = match &base {
        Some(base) => format!("from {}", base.dir().display()),
        None => args.model.to_string(),
    };
    println!(
        "model {} ({} parameters, vocab {}, MLP {:?}), {} + {} tokens (training + validation), \
         device {}",
        model_name,
        human_count(model.param_count()),
        model.vocab_size,
        model.mlp,
        corpus.train().len(),
        corpus.valid().len(),
        describe(&device)
    );
    println!(
        "stack {}: attention {:?}, loss {:?}, blocks {:?}, linears {:?}, savers {:?} (saved \
         {:?}), optimizer {:?}{}{}, {:?}",
        stack.name,
        model.attention,
        model.loss,
        model.blocks,
        model.linear,
        model.savers,
        model.saved_precision,
        optimizer,
        match switches.block_coordinate {
            Some(schedule) => format!(
                " one block at a time ({} steps each, {:?}, inactive state {:?}{})",
                schedule.switch_every,
                schedule.order,
                schedule.inactive_state,
                match schedule.weights_on_host {
                    true => ", inactive weights in host memory",
                    false => "",
                }
            ),
            None => String::new(),
        },
        match switches.host_offload {
            Some(HostOffload::State) => ", its state in host memory",
            Some(HostOffload::Update) => ", its state and update on the host",
            None => "",
        },
        precision
    );
    if let Some(lora) = &lora {
        lora.validate(&model)?;
        println!(
            "LoRA rank {}, alpha {}: {} trainable parameters on the blocks' linears, the rest frozen",
            lora.rank,
            lora.alpha,
            human_count(lora.trainable_parameters(&model))
        );
    }
    let decay = match args.decay {
        0 => String::new(),
        steps => format!(", cosine decay over {steps} steps to {}", args.final_lr),
    };
    println!(
        "learning rate {} after {} warm-up steps{decay}, then constant",
        args.lr, args.warmup
    );
    let caption = format!(
        "{} ({} parameters), stack {}, seq {}, batch {}, {}",
        args.model,
        human_count(model.param_count()),
        stack.name,
        args.seq,
        args.batch,
        describe(&device)
    );

    let start = if args.resume {
        Start::Resume {
            allow_change: args.allow_change,
        }
    } else if args.overwrite {
        Start::Overwrite
    } else {
        Start::Fresh
    };
    let meter = MemoryMeter::new(&device);
    let started = Instant::now();
    let report = train(
        &RunConfig::new(model, training).with_base(args.from.clone()),
        &corpus,
        &device,
        &artifacts,
        &start,
        false,
    )?;

    let last = report.epochs.last().ok_or("no epoch was trained")?;
    let mean_speed = report
        .epochs
        .iter()
        .map(|e| e.train_tokens_per_s)
        .sum::<f64>()
        / report.epochs.len() as f64;
    println!("\nsummary");
    println!("  final train loss       {:.4}", last.train_loss);
    println!(
        "  final validation loss  {:.4}  (perplexity {:.2})",
        last.valid_loss,
        last.valid_loss.exp()
    );
    println!("  training speed         {mean_speed:.0} tokens/s");
    if let Some(scale) = report.loss_scale {
        println!(
            "  loss scale             {} at the end; {} parameter updates skipped for an overflow",
            scale.scale, scale.skipped_updates
        );
    }
    let memory = report.step_memory;
    println!(
        "  peak of a step         {} ({}), persistent {}, peak / persistent {:.2}",
        human_bytes(memory.peak_bytes),
        meter.source(),
        human_bytes(memory.live_bytes),
        memory.peak_bytes as f64 / memory.live_bytes.max(1) as f64
    );
    if memory.checkpoint_peak_bytes > 0 {
        println!(
            "  peak of a checkpoint   {} ({:.2} × persistent)",
            human_bytes(memory.checkpoint_peak_bytes),
            memory.checkpoint_peak_bytes as f64 / memory.live_bytes.max(1) as f64
        );
    }
    println!(
        "  wall time              {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!("  weights                {}", artifacts.weights().display());
    if lora.is_some() {
        println!(
            "  adapters               {}",
            artifacts.adapters().display()
        );
    }
    if matches!(base, Some(Pretrained::Llama(_))) {
        println!(
            "  as a Llama checkpoint  {}",
            artifacts.llama_export().display()
        );
    }
    println!(
        "  tokenizer              {}",
        artifacts.tokenizer().display()
    );
    let plot = artifacts.loss_plot();
    plot_loss(&artifacts.loss_curve()?, &caption, &plot)?;
    println!("  loss curve             {}", plot.display());
    Ok(())
}

/// The loss of every step of the run (resumed parts included) and each epoch's validation loss.
fn plot_loss(
    curve: &LossCurve,
    caption: &str,
    path: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let steps = curve.train.len().max(1) as f64;
    let losses = curve
        .train
        .iter()
        .chain(&curve.valid)
        .map(|&(_, loss)| loss);
    let highest = losses.fold(0.0, f64::max).max(1e-3);
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..steps, 0.0..highest * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("training step")
        .x_label_formatter(&|step| format!("{step:.0}"))
        .y_desc("loss (nats per token)")
        .draw()?;
    let train_color = RGBColor(31, 119, 180);
    chart
        .draw_series(LineSeries::new(
            curve.train.iter().map(|&(step, loss)| (step as f64, loss)),
            train_color,
        ))?
        .label("train (each step)")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], train_color));
    let valid_color = RGBColor(214, 39, 40);
    chart
        .draw_series(LineSeries::new(
            curve.valid.iter().map(|&(step, loss)| (step as f64, loss)),
            valid_color.stroke_width(2),
        ))?
        .label("validation (each epoch)")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], valid_color));
    chart.draw_series(
        curve
            .valid
            .iter()
            .map(|&(step, loss)| Circle::new((step as f64, loss), 3, valid_color.filled())),
    )?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// The parts and schedule settings that the flags choose beside the stack.
fn overrides(args: &Args) -> Overrides {
    Overrides {
        attention: args.attention.map(|attention| match attention {
            AttentionArg::Burn => AttentionKind::Burn,
            AttentionArg::Flash => AttentionKind::Flash,
        }),
        loss: args.loss.map(|loss| match loss {
            LossArg::Burn => LossKind::Burn,
            LossArg::Fused => LossKind::Fused,
        }),
        blocks: args.blocks.map(|blocks| match blocks {
            BlocksArg::Standard => BlockKind::Standard,
            BlocksArg::Reversible => BlockKind::Reversible,
        }),
        linear: args.linear.map(|linear| match linear {
            LinearArg::Dense => LinearKind::Dense,
            LinearArg::Ternary => LinearKind::Ternary,
            LinearArg::Counter => LinearKind::Counter,
            LinearArg::CounterAll => LinearKind::CounterAll,
        }),
        savers: args.savers.map(|savers| match savers {
            SaversArg::None => (SaverKind::Burn, SavedPrecision::Full),
            SaversArg::Exact => (SaverKind::Exact, SavedPrecision::Full),
            SaversArg::Int8 => (SaverKind::Exact, SavedPrecision::Int8),
            SaversArg::Int4 => (SaverKind::Exact, SavedPrecision::Int4),
        }),
        host_offload: args.offload,
        schedule: ScheduleOverrides {
            switch_every: args.switch_every,
            order: args.block_order.map(|order| match order {
                BlockOrderArg::Ascending => BlockOrder::Ascending,
                BlockOrderArg::Descending => BlockOrder::Descending,
                BlockOrderArg::Random => BlockOrder::Random { seed: args.seed },
            }),
            keep_state: args.keep_block_state,
            weights_on_host: args.weights_on_host,
        },
    }
}

/// Keeps the base model's blocks and linears, which define the function its weights compute:
/// a stack's other choice is said and replaced, an explicit `--blocks` or `--linear` refused.
fn keep_the_function(
    switches: &mut Switches,
    base: &LmConfig,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    if switches.blocks == base.blocks && switches.linear == base.linear {
        return Ok(());
    }
    if args.blocks.is_some() || args.linear.is_some() {
        return Err(format!(
            "--blocks and --linear must be the model's own ({:?} blocks, {:?} linears) when \
             fine-tuning it: others compute another function of its weights",
            base.blocks, base.linear
        )
        .into());
    }
    println!(
        "the stack's {:?} blocks and {:?} linears would compute another function of the \
         model's weights: keeping its {:?} blocks and {:?} linears",
        switches.blocks, switches.linear, base.blocks, base.linear
    );
    switches.blocks = base.blocks;
    switches.linear = base.linear;
    Ok(())
}

/// The cheapest stack whose predicted step fits in `available` bytes, said with why. From a
/// checkpoint, only the stacks that keep its blocks and linears.
fn fit_stack(
    model: &LmConfig,
    args: &Args,
    precision: Precision,
    device: &Device,
    available: u64,
) -> Result<NamedSwitches, Box<dyn std::error::Error>> {
    let shape = args.weights.step_shape(precision, args.batch, args.seq);
    // With `--weights-on-host`, the stacks that train one block at a time as that flag runs them.
    let stacks = every_stack()
        .into_iter()
        .map(|stack| stack.with_weights_on_host(args.weights_on_host));
    let plan = Plan::of_stacks(
        model,
        shape,
        precision.half_update(),
        DeviceMemory::of(device),
        stacks,
    )?;
    let keeps_the_model = |candidate: &&Candidate| {
        args.from.is_none()
            || (candidate.stack.switches.blocks == model.blocks
                && candidate.stack.switches.linear == model.linear)
    };
    let fitting: Vec<&Candidate> = plan
        .fitting(available)?
        .into_iter()
        .filter(keeps_the_model)
        .collect();
    let Some(&chosen) = fitting.first() else {
        return Err(format!(
            "no stack that keeps the checkpoint's blocks and linears fits in {}",
            human_bytes(available)
        )
        .into());
    };
    println!(
        "--fit {}: stack {}, the cheapest in step time ({:.2}× baseline's) of the {} stacks \
         whose predicted peak on {} fits; predicted peak {} (at the {})",
        human_bytes(available),
        chosen.stack.name,
        chosen.step_time,
        fitting.len(),
        describe(device),
        human_bytes(chosen.peak),
        chosen.budget.peak_phase().name
    );
    Ok(chosen.stack)
}

fn list_models() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "{:<10} {:>10} {:>6} {:>7} {:>6} {:>9} {:>6} {:>8}",
        "model", "parameters", "d", "layers", "heads", "kv heads", "vocab", "context"
    );
    for name in PRESETS {
        let c = LmConfig::preset(name)?;
        println!(
            "{name:<10} {:>10} {:>6} {:>7} {:>6} {:>9} {:>6} {:>8}",
            human_count(c.param_count()),
            c.d_model,
            c.n_layers,
            c.n_heads,
            c.n_kv_heads,
            c.vocab_size,
            c.max_seq_len
        );
    }
    println!("(training replaces the vocabulary with the tokenizer's)");
    Ok(())
}
