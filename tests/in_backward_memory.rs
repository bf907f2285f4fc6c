//! The in-backward optimizer removes the gradient pool from a training step of the `small` LM.
//! With AdamW after backward, the step's peak holds every parameter's gradient at once; with
//! AdamW during backward it holds the persistent state, what the forward pass saved, and about
//! one parameter's gradient.

use burn_memwall::memory::CountingAllocator;
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::LmConfig;
use burn_memwall_models::training::{StepOptimizer, measure_steps};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[test]
fn an_in_backward_step_holds_no_gradient_pool() {
    // Short windows keep the saved activations well below the 42 MiB of gradients of the 11M
    // parameters, so that the gradient pool is what sets the baseline's peak.
    let config = LmConfig::preset("small").unwrap();
    let (seq, batch) = (16, 1);
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect();
    // Flex only: a Cube device's pool reports a high-water mark of reserved pages that cannot
    // be reset, so two steps in one process cannot be told apart there (memgate runs each stack
    // in its own process instead).
    let device = burn::prelude::Device::flex();
    let measure = |optimizer| {
        measure_steps(&config, optimizer, &windows, batch, 3, 1e-3, 7, &device).unwrap()
    };
    let baseline = measure(StepOptimizer::AdamW);
    let in_backward = measure(StepOptimizer::InBackwardAdamW);
    let (base, ib) = (baseline.pools, in_backward.pools);
    // `gradients` is every parameter's for the baseline, the largest one's in backward.
    let (gradient_pool, largest_gradient) = (base.gradients, ib.gradients);
    let bound = (ib.persistent() + in_backward.saved_activations + largest_gradient) as f64 * 1.1;
    assert!(
        ib.peak as f64 <= bound,
        "in-backward peak {} > {bound:.0} = 1.1 × (persistent {} + saved \
         activations {} + largest gradient {largest_gradient})",
        ib.peak,
        ib.persistent(),
        in_backward.saved_activations,
    );
    assert!(
        base.peak as f64 >= base.persistent() as f64 + 0.95 * gradient_pool as f64,
        "the baseline peak {} should hold persistent {} + every gradient \
         {gradient_pool}",
        base.peak,
        base.persistent(),
    );
    let lower = base.peak.saturating_sub(ib.peak);
    assert!(
        lower as f64 >= 0.5 * gradient_pool as f64,
        "in backward the peak is only {lower} lower than the baseline's {}; \
         the gradient pool is {gradient_pool}",
        base.peak,
    );
}
