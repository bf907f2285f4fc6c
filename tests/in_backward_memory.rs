//! The in-backward optimizer removes the gradient pool from a training step of the `small` LM.
//! With AdamW after backward, the step's peak holds every parameter's gradient at once; with
//! AdamW during backward it holds the persistent state, the activations, and about one
//! parameter's gradient. Trained through burn-train's Learner (the project's `train`, which
//! runs `InBackwardTraining`), the step holds what it holds in a plain loop.

mod common;

use burn::prelude::*;
use burn_memwall::memory::CountingAllocator;
use burn_memwall_models::data::{Corpus, DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::LmConfig;
use burn_memwall_models::training::{
    Artifacts, RunConfig, Start, StepMeasurement, StepOptimizer, TrainReport, TrainingConfig, train,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Tokens per window (one window per batch). Short windows keep the activations well below the
/// 42 MiB of gradients of the `small` LM's 11M parameters, so that the gradient pool is what
/// sets the baseline's peak.
const SEQ: usize = 16;
/// Training steps per measurement.
const STEPS: usize = 3;

/// Three steps (the first a warm-up) of the `small` LM in a plain loop.
fn measure(optimizer: StepOptimizer, device: &Device) -> StepMeasurement {
    let config = LmConfig::preset("small").unwrap();
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(SEQ + 1).map(<[u32]>::to_vec).collect();
    common::measure_steps(&config, optimizer, &windows, 1, STEPS, device)
}

/// The highest step peak of one epoch of three steps of the same model through the Learner,
/// above what was live before the run; a first run warms the runtime up, as [`measure`] does.
fn learner_peak(optimizer: StepOptimizer, device: &Device) -> u64 {
    learner_run(optimizer, device);
    learner_run(optimizer, device).step_memory.peak_bytes
}

/// One epoch of three steps of the same model as [`measure`]'s through the Learner.
fn learner_run(optimizer: StepOptimizer, device: &Device) -> TrainReport {
    let model = LmConfig::preset("small").unwrap();
    let training = TrainingConfig::new()
        .with_seq_len(SEQ)
        .with_batch_size(1)
        .with_epochs(1)
        .with_max_steps_per_epoch(Some(STEPS))
        .with_learning_rate(1e-3)
        .with_optimizer(optimizer)
        .with_seed(7);
    let run = RunConfig::new(model, training);
    let corpus = Corpus::new(TextTokenizer::byte_level(), DEFAULT_CORPUS, 0.1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    train(
        &run,
        &corpus,
        device,
        &Artifacts::new(dir.path()),
        &Start::Fresh,
        true,
    )
    .unwrap()
}

/// The claims, given what bounds the activations in the in-backward step: the peak is at most
/// 1.1 × (persistent + activations + largest gradient); the baseline's holds the gradient pool;
/// and in backward the peak is lower by at least half that pool.
fn assert_no_gradient_pool(
    baseline: &StepMeasurement,
    in_backward: &StepMeasurement,
    activations: u64,
    context: &str,
) {
    let (base, ib) = (baseline.pools, in_backward.pools);
    // `gradients` is every parameter's for the baseline, the largest one's in backward.
    let (gradient_pool, largest_gradient) = (base.gradients, ib.gradients);
    let bound = (ib.persistent() + activations + largest_gradient) as f64 * 1.1;
    eprintln!(
        "{context}: baseline peak {}, in-backward peak {}, bound {bound:.0}, pool {gradient_pool}",
        base.peak, ib.peak
    );
    assert!(
        ib.peak as f64 <= bound,
        "{context}: in-backward peak {} > {bound:.0} = 1.1 × (persistent {} + activations \
         {activations} + largest gradient {largest_gradient})",
        ib.peak,
        ib.persistent(),
    );
    assert!(
        base.peak as f64 >= base.persistent() as f64 + 0.95 * gradient_pool as f64,
        "{context}: the baseline peak {} should hold persistent {} + every gradient \
         {gradient_pool}",
        base.peak,
        base.persistent(),
    );
    let lower = base.peak.saturating_sub(ib.peak);
    assert!(
        lower as f64 >= 0.5 * gradient_pool as f64,
        "{context}: in backward the peak is only {lower} lower than the baseline's {}; the \
         gradient pool is {gradient_pool}",
        base.peak,
    );
}

/// On Flex the peak window resets between steps, so both stacks run here, and the activations
/// are what the forward pass saved (measured).
#[test]
fn an_in_backward_step_holds_no_gradient_pool() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let baseline = measure(StepOptimizer::AdamW, &device);
    let in_backward = measure(StepOptimizer::InBackwardAdamW, &device);
    let activations = in_backward.saved_activations;
    assert_no_gradient_pool(&baseline, &in_backward, activations, "flex, AdamW");
}

/// Through burn-train's Learner (the project's `train`, which runs `InBackwardTraining`) a step
/// holds what it holds in the plain loop; Burn's own loop would keep the old weights beside
/// their updates, as the Learner with AdamW after backward keeps the gradient pool.
#[test]
fn the_learner_keeps_the_in_backward_gain() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let plain = measure(StepOptimizer::InBackwardFusedAdamW, &device);
    let learner = learner_peak(StepOptimizer::InBackwardFusedAdamW, &device);
    let peak = plain.pools.peak;
    eprintln!("flex, FusedAdamW: learner in backward {learner}, plain loop {peak}");
    let ratio = learner as f64 / peak as f64;
    assert!(
        (0.95..=1.05).contains(&ratio),
        "the Learner's in-backward step peak {learner} is {ratio:.3}× the plain loop's {peak}"
    );
    // The reading sees the gradient pool when it is there: one f32 per (dense) parameter.
    let pool = plain.pools.parameters;
    let learner_baseline = learner_peak(StepOptimizer::AdamW, &device);
    eprintln!("flex: learner baseline {learner_baseline}");
    assert!(
        learner_baseline.saturating_sub(learner) as f64 >= 0.5 * pool as f64,
        "the Learner's baseline step peak {learner_baseline} should hold the gradient pool \
         ({pool}) above the in-backward one's {learner}"
    );
}

/// A checkpoint between epochs holds about one parameter (or one parameter's AdamW state)
/// beside the run's state: the model is read back one tensor at a time as it is written, and
/// the optimizer state one parameter at a time. burn-train's checkpointer copies the whole
/// model and the whole optimizer state to the host first.
#[test]
fn a_checkpoint_holds_one_parameter_beside_the_model() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let config = LmConfig::preset("small").unwrap();
    let model_bytes = config.param_count() as u64 * 4;
    // The embedding (and the head beside it) is the largest tensor.
    let largest = (config.vocab_size * config.d_model) as u64 * 4;
    for optimizer in [
        StepOptimizer::InBackwardSgd,
        StepOptimizer::InBackwardFusedAdamW,
    ] {
        let memory = learner_run(optimizer, &device).step_memory;
        let above = memory
            .checkpoint_peak_bytes
            .saturating_sub(memory.live_bytes);
        eprintln!(
            "flex, {optimizer:?}: checkpoint peak {} over persistent {}: {above} above, \
             largest parameter {largest}, model {model_bytes}",
            memory.checkpoint_peak_bytes, memory.live_bytes
        );
        assert!(
            memory.checkpoint_peak_bytes > 0,
            "no checkpoint was measured"
        );
        // Measured on Flex: 2.0 of the largest parameter with SGD (reading a tensor back makes
        // a second, passing copy), 3.0 with AdamW (its two moments, and one passing copy).
        // The bound leaves room for what the metric threads allocate meanwhile, and is far
        // below a copy of the model (and, with AdamW, of its state: twice the model).
        let bound = 4 * largest;
        assert!(
            above <= bound,
            "{optimizer:?}: the checkpoint held {above} bytes above the persistent state, more \
             than four of the largest parameter ({largest}); the model is {model_bytes}"
        );
    }
}

/// Names the stack a child process measures, for [`measure_one_wgpu_stack`].
const STACK_VARIABLE: &str = "IN_BACKWARD_MEMORY_STACK";
/// Marks the line a child reports its measurement on.
const REPORT_PREFIX: &str = "in-backward-memory ";

/// A Cube pool's peak is a high-water mark of reserved pages that cannot be reset, so each
/// stack runs in a child process ([`measure_one_wgpu_stack`]). The pools reserve whole pages,
/// so the activation term is the baseline's activations and workspace at its peak, measured by
/// the same meter. Burn's AdamW makes several temporaries per update on Cube; the claim is made
/// with the in-place `FusedAdamW`, the decorator's intended partner there.
#[test]
fn an_in_backward_step_holds_no_gradient_pool_on_wgpu() {
    if common::devices().len() < 2 {
        eprintln!("no wgpu device: nothing to measure");
        return;
    }
    let baseline = parse_report(&wgpu_child("baseline"));
    let in_backward = parse_report(&wgpu_child("in-backward-fused-adamw"));
    let activations = baseline.pools.activations_and_workspace;
    assert_no_gradient_pool(&baseline, &in_backward, activations, "wgpu, FusedAdamW");
}

#[test]
fn the_learner_keeps_the_in_backward_gain_on_wgpu() {
    if common::devices().len() < 2 {
        eprintln!("no wgpu device: nothing to measure");
        return;
    }
    // A Cube pool's peak is a high-water mark of reserved pages that cannot be reset, and a
    // reading above a start depends on what that start held. So one child runs the plain loop,
    // then the Learner, and reports the pools' high-water mark after the plain steps and after
    // the Learner's steps: the Learner's must not raise the plain loop's by more than 5%.
    let report = wgpu_child("plain-then-learner");
    let marks: Vec<u64> = report.split(' ').map(|n| n.parse().unwrap()).collect();
    let (plain, learner) = (marks[0], marks[1]);
    eprintln!(
        "wgpu, FusedAdamW: high-water after the plain steps {plain}, after the Learner's {learner}"
    );
    assert!(
        learner as f64 <= 1.05 * plain as f64,
        "the Learner's steps raised the pools' high-water mark from {plain} to {learner}"
    );
}

/// Runs [`measure_one_wgpu_stack`] for `stack` in a child process and returns its report.
fn wgpu_child(stack: &str) -> String {
    common::child_report(
        "measure_one_wgpu_stack",
        (STACK_VARIABLE, stack),
        REPORT_PREFIX,
    )
}

#[test]
#[ignore = "a child process of an_in_backward_step_holds_no_gradient_pool_on_wgpu"]
fn measure_one_wgpu_stack() {
    let stack = std::env::var(STACK_VARIABLE).expect("run by the wgpu memory test");
    let (through_learner, optimizer) = match stack.as_str() {
        "baseline" => (false, StepOptimizer::AdamW),
        "in-backward-fused-adamw" => (false, StepOptimizer::InBackwardFusedAdamW),
        "plain-then-learner" => (true, StepOptimizer::InBackwardFusedAdamW),
        other => panic!("unknown stack {other}"),
    };
    let device = burn_memwall::DeviceChoice::Wgpu.device().unwrap();
    if through_learner {
        let meter = burn_memwall::memory::MemoryMeter::new(&device);
        measure(optimizer, &device);
        let plain = meter.peak_bytes();
        let report = learner_run(optimizer, &device);
        let learner = report.step_memory.peak_bytes + report.live_before_bytes;
        println!("{REPORT_PREFIX}{plain} {learner}");
        return;
    }
    let measured = measure(optimizer, &device);
    let pools = measured.pools;
    println!(
        "{REPORT_PREFIX}{} {} {} {} {} {}",
        pools.peak,
        pools.parameters,
        pools.optimizer_state,
        pools.gradients,
        measured.saved_activations,
        measured.loss
    );
}

fn parse_report(report: &str) -> StepMeasurement {
    let fields: Vec<&str> = report.split(' ').collect();
    let number = |i: usize| fields[i].parse::<u64>().expect("a byte count");
    let pools =
        burn_memwall::memory::PoolBreakdown::new(number(0), number(1), number(2), number(3));
    StepMeasurement {
        pools,
        saved_activations: number(4),
        tokens_per_s: f64::NAN,
        loss: fields[5].parse().expect("a loss"),
    }
}
