//! The memory harness measures what a training step really holds.

mod common;

use burn::prelude::*;
use burn_memwall::memory::{CountingAllocator, MemoryMeter, PoolBreakdown};
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::LmConfig;
use burn_memwall_models::training::StepOptimizer;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const MIB: u64 = 1 << 20;

#[test]
fn the_meter_sees_a_tensor_come_and_go() {
    let _turn = common::take_turn(); // peak readings are process-wide
    for device in common::devices() {
        let meter = MemoryMeter::new(&device);
        assert!(meter.is_available());
        meter.reset_peak();
        let tensor = Tensor::<2>::ones([1024, 16 * 1024], &device); // 64 MiB of f32
        let with_tensor = meter.live_bytes();
        assert!(
            with_tensor >= 64 * MIB,
            "{device:?}: live {with_tensor} after a 64 MiB tensor"
        );
        assert!(meter.peak_bytes() >= with_tensor);
        drop(tensor);
        let freed = with_tensor.saturating_sub(meter.live_bytes());
        assert!(
            (63 * MIB..66 * MIB).contains(&freed),
            "{device:?}: dropping 64 MiB freed {freed} bytes"
        );
    }
}

#[test]
fn pools_split_the_peak() {
    let pools = PoolBreakdown::new(1000, 100, 200, 100);
    assert_eq!(pools.activations_and_workspace, 600);
    assert_eq!(pools.persistent(), 300);
    assert_eq!(
        PoolBreakdown::new(100, 100, 200, 100).activations_and_workspace,
        0
    );
}

/// The baseline step must hold at least its logits and their gradient, parameters, AdamW's two
/// moments and the gradients; its activation pool grows in proportion to the batch.
#[test]
fn a_baseline_step_holds_its_logits_and_scales_with_the_batch() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let config = LmConfig::new(2048, 64, 2, 4, 4, 128, 128);
    let (seq, vocab) = (128usize, config.vocab_size);
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect();

    let measure =
        |batch| common::measure_steps(&config, StepOptimizer::AdamW, &windows, batch, 3, &device);
    let (small, large) = (measure(2), measure(4));
    let params = (config.param_count() * 4) as u64;
    assert_eq!(small.pools.parameters, params);
    let state = small.pools.optimizer_state as f64;
    assert!(
        (1.9..2.5).contains(&(state / params as f64)),
        "AdamW keeps two moments: {state} vs {params}"
    );

    for (batch, m) in [(2u64, &small), (4, &large)] {
        let logits = batch * (seq * vocab * 4) as u64;
        assert!(
            m.pools.activations_and_workspace >= 2 * logits,
            "logits and their gradient: {:?}",
            m.pools
        );
        assert!(m.loss.is_finite() && m.tokens_per_s > 0.0);
    }
    let growth =
        large.pools.activations_and_workspace as f64 / small.pools.activations_and_workspace as f64;
    assert!(
        (1.6..2.4).contains(&growth),
        "activations grow with the batch: ×{growth:.2}"
    );
}

/// The reversible LM (full-width couplings, flash attention, the fused loss) leaves its forward
/// pass's saved activations flat in depth; the same model with standard blocks grows with it.
#[test]
fn the_reversible_model_saves_the_same_activations_at_any_depth() {
    use burn_memwall_models::lm::{AttentionKind, BlockKind, LossKind};
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let seq = 64;
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect();
    let saved = |blocks, depth| {
        let config = LmConfig::new(256, 64, depth, 4, 2, 128, seq)
            .with_attention(AttentionKind::Flash)
            .with_loss(LossKind::Fused)
            .with_blocks(blocks);
        common::measure_steps(&config, StepOptimizer::AdamW, &windows, 4, 3, &device)
            .saved_activations as f64
    };
    let reversible = saved(BlockKind::Reversible, 8) / saved(BlockKind::Reversible, 2);
    let standard = saved(BlockKind::Standard, 8) / saved(BlockKind::Standard, 2);
    eprintln!(
        "saved activations, depth 2 → 8: reversible ×{reversible:.2}, standard ×{standard:.2}"
    );
    assert!(
        reversible <= 1.2,
        "reversible: ×{reversible:.2} for ×4 depth"
    );
    assert!(
        standard >= 2.5,
        "the measurement must see the standard blocks grow: ×{standard:.2}"
    );
}
