//! The memory budget predicts what a training step holds, before the step runs.

mod common;

use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::memory::budget::{DeviceMemory, ParameterCensus, Term};
use burn_memwall::memory::human_bytes;
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::{
    AttentionKind, BlockKind, LmConfig, LossKind, PRESETS, StepShape, parameter_census,
    saved_activations,
};
use burn_memwall_models::training::{Plan, StepOptimizer, measure_training_steps};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// How far a prediction may be from the measurement. The formulas are exact for the tensors;
/// what they cannot see is the heap's own rounding and the graph's maps growing by doubling.
const TOLERANCE: f64 = 0.02;

/// How far a predicted step peak may be from the measured one. The phases leave out the
/// graph's bookkeeping while backward runs and the matmul's packing buffers; every tensor is
/// counted. Leaving out the gradients, the optimizer state or the saved activations moves rows
/// past it (the gradients are 17–23% of the after-backward peaks here).
const PEAK_TOLERANCE: f64 = 0.05;

/// The byte ids of the embedded corpus, cut into windows of `seq + 1`.
fn windows(seq: usize) -> Vec<Vec<u32>> {
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect()
}

/// For every stack the budget models (all but the quantised linears), on `tiny` and `small` at
/// two sequence lengths, the predicted peak of a training step is the measured one (Flex).
#[test]
fn the_step_peak_is_predicted_for_every_stack() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let mut failures = Vec::new();
    for model in ["tiny", "small"] {
        for seq in [64, 256] {
            let windows = windows(seq);
            let base = LmConfig::preset(model).unwrap();
            let plan = Plan::new(&base, StepShape::f32(2, seq), DeviceMemory::Heap).unwrap();
            for candidate in &plan.candidates {
                let mut config = base.clone();
                let optimizer = candidate.stack.switches.apply(&mut config);
                let measured =
                    measure_training_steps(&config, optimizer, &windows, 2, 2, 1e-3, 7, &device)
                        .unwrap()
                        .pools
                        .peak;
                let peak = candidate.budget.peak_phase();
                let ratio = peak.bytes() as f64 / measured as f64;
                let row = format!(
                    "{model} seq {seq} {}: predicted {} at {}, measured {measured} (×{ratio:.4})",
                    candidate.stack.name,
                    peak.bytes(),
                    peak.name
                );
                eprintln!("{row}");
                if (ratio - 1.0).abs() > PEAK_TOLERANCE {
                    failures.push(row);
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "off by more than {PEAK_TOLERANCE}: {failures:#?}"
    );
}

/// For every combination of attention, loss and blocks, with and without in-backward routing,
/// at two sequence lengths, the predicted saved activations are the measured ones (Flex, whose
/// heap the counting allocator reads). Leaving out the tied head's copy (checked by hand), the
/// graph's bookkeeping or the routed chain's uses moves a prediction outside the tolerance.
#[test]
fn the_saved_activations_are_predicted_for_every_stack() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let mut failures = Vec::new();
    for seq in [32, 128] {
        let windows = windows(seq);
        let shape = StepShape::f32(2, seq);
        for attention in [AttentionKind::Burn, AttentionKind::Flash] {
            for loss in [LossKind::Burn, LossKind::Fused] {
                for blocks in [BlockKind::Standard, BlockKind::Reversible] {
                    for optimizer in [StepOptimizer::AdamW, StepOptimizer::InBackwardFusedAdamW] {
                        let config = LmConfig::preset("tiny")
                            .unwrap()
                            .with_attention(attention)
                            .with_loss(loss)
                            .with_blocks(blocks);
                        let routed = optimizer.in_backward().is_some();
                        let predicted: u64 = saved_activations(&config, shape, routed)
                            .unwrap()
                            .iter()
                            .map(|term: &Term| term.bytes)
                            .sum();
                        let measured = measure_training_steps(
                            &config, optimizer, &windows, 2, 2, 1e-3, 7, &device,
                        )
                        .unwrap()
                        .saved_activations;
                        let ratio = predicted as f64 / measured as f64;
                        let row = format!(
                            "seq {seq} {attention:?} {loss:?} {blocks:?} {optimizer:?}: \
                             predicted {predicted}, measured {measured} (×{ratio:.4})"
                        );
                        eprintln!("{row}");
                        if (ratio - 1.0).abs() > TOLERANCE {
                            failures.push(row);
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "off by more than {TOLERANCE}: {failures:#?}"
    );
}

/// The census from a config's shapes is the census of the model it builds, for every preset
/// and with the head tied or not.
#[test]
fn the_parameters_are_counted_from_the_config_as_from_the_model() {
    let device = Device::flex();
    for name in PRESETS {
        for tied in [true, false] {
            let config = LmConfig::preset(name).unwrap().with_tie_embeddings(tied);
            let model = config.init(&device).unwrap();
            assert_eq!(
                parameter_census(&config, DType::F32).unwrap(),
                ParameterCensus::of(&model, DType::F32),
                "{name}, tied {tied}"
            );
        }
    }
}

#[test]
fn quantised_linears_are_refused_rather_than_mispredicted() {
    use burn_memwall_models::lm::LinearKind;
    let config = LmConfig::preset("tiny")
        .unwrap()
        .with_linear(LinearKind::Counter);
    let error = saved_activations(&config, StepShape::f32(1, 8), false).unwrap_err();
    assert!(error.to_string().contains("dense linears only"), "{error}");
    assert!(parameter_census(&config, DType::F32).is_err());
}

/// The planner names the cheapest stack that fits, and when none does, the smallest budget
/// that would work.
#[test]
fn the_planner_picks_the_cheapest_stack_that_fits() {
    let config = LmConfig::preset("small").unwrap();
    let plan = Plan::new(&config, StepShape::f32(2, 256), DeviceMemory::Heap).unwrap();
    let everything = plan.fitting(u64::MAX);
    assert_eq!(everything.len(), plan.candidates.len());
    let times: Vec<f64> = everything.iter().map(|c| c.step_time).collect();
    assert!(times.is_sorted(), "cheapest first: {times:?}");
    let cheapest = plan.choose(u64::MAX).unwrap();
    assert!(
        plan.candidates
            .iter()
            .all(|c| c.step_time >= cheapest.step_time)
    );

    let smallest = plan.smallest();
    let tight = smallest.budget.peak();
    assert!(
        plan.candidates.iter().all(|c| c.budget.peak() >= tight),
        "the smallest peak is the smallest"
    );
    assert_eq!(plan.choose(tight).unwrap().budget.peak(), tight);
    assert!(plan.fitting(tight).iter().all(|c| c.budget.peak() == tight));

    let error = plan.choose(tight - 1).unwrap_err().to_string();
    assert!(
        error.contains(&human_bytes(tight)) && error.contains(smallest.stack.name),
        "{error}"
    );
}

#[test]
fn a_sequence_over_the_context_is_refused() {
    let config = LmConfig::preset("tiny").unwrap();
    let seq = config.max_seq_len + 1;
    let error = Plan::new(&config, StepShape::f32(1, seq), DeviceMemory::Heap)
        .unwrap_err()
        .to_string();
    assert!(error.contains(&format!("sequence length {seq}")), "{error}");
}
