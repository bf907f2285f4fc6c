//! The in-backward optimizer removes the gradient pool from a training step of the `small` LM.
//! With AdamW after backward, the step's peak holds every parameter's gradient at once; with
//! AdamW during backward it holds the persistent state, the activations, and about one
//! parameter's gradient.

mod common;

use burn::prelude::*;
use burn_memwall::memory::CountingAllocator;
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::LmConfig;
use burn_memwall_models::training::{StepMeasurement, StepOptimizer, measure_steps};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Three steps (the first a warm-up) of the `small` LM. Short windows keep the activations well
/// below the 42 MiB of gradients of its 11M parameters, so that the gradient pool is what sets
/// the baseline's peak.
fn measure(optimizer: StepOptimizer, device: &Device) -> StepMeasurement {
    let config = LmConfig::preset("small").unwrap();
    let (seq, batch) = (16, 1);
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect();
    measure_steps(&config, optimizer, &windows, batch, 3, 1e-3, 7, device).unwrap()
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
    let device = Device::flex();
    let baseline = measure(StepOptimizer::AdamW, &device);
    let in_backward = measure(StepOptimizer::InBackwardAdamW, &device);
    let activations = in_backward.saved_activations;
    assert_no_gradient_pool(&baseline, &in_backward, activations, "flex, AdamW");
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
    let child = |stack: &str| -> StepMeasurement {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "measure_one_wgpu_stack",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env(STACK_VARIABLE, stack)
            .output()
            .expect("the test binary runs again");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let report = stdout
            .lines()
            .find_map(|line| line.strip_prefix(REPORT_PREFIX));
        let Some(report) = report.filter(|_| output.status.success()) else {
            panic!(
                "measuring {stack} failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        };
        parse_report(report)
    };
    let baseline = child("baseline");
    let in_backward = child("in-backward-fused-adamw");
    let activations = baseline.pools.activations_and_workspace;
    assert_no_gradient_pool(&baseline, &in_backward, activations, "wgpu, FusedAdamW");
}

#[test]
#[ignore = "a child process of an_in_backward_step_holds_no_gradient_pool_on_wgpu"]
fn measure_one_wgpu_stack() {
    let stack = std::env::var(STACK_VARIABLE).expect("run by the wgpu memory test");
    let optimizer = match stack.as_str() {
        "baseline" => StepOptimizer::AdamW,
        "in-backward-fused-adamw" => StepOptimizer::InBackwardFusedAdamW,
        other => panic!("unknown stack {other}"),
    };
    let device = burn_memwall::DeviceChoice::Wgpu.device().unwrap();
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
