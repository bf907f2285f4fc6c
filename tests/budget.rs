//! The memory budget predicts what a training step holds, before the step runs.

mod common;

use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::memory::budget::{ParameterCensus, Term};
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::{
    AttentionKind, BatchShape, BlockKind, LmConfig, LossKind, PRESETS, parameter_census,
    saved_activations,
};
use burn_memwall_models::training::{StepOptimizer, measure_training_steps};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// How far a prediction may be from the measurement. The formulas are exact for the tensors;
/// what they cannot see is the heap's own rounding and the graph's maps growing by doubling.
const TOLERANCE: f64 = 0.02;

/// For every combination of attention, loss and blocks, with and without in-backward routing,
/// at two sequence lengths, the predicted saved activations are the measured ones (Flex, whose
/// heap the counting allocator reads). Leaving out the tied head's copy (checked by hand), the
/// graph's bookkeeping or the routed chain's uses moves a prediction outside the tolerance.
#[test]
fn the_saved_activations_are_predicted_for_every_stack() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let mut failures = Vec::new();
    for seq in [32, 128] {
        let windows: Vec<Vec<u32>> = tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect();
        let shape = BatchShape { batch: 2, seq };
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
                parameter_census(&config).unwrap(),
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
    let error = saved_activations(&config, BatchShape { batch: 1, seq: 8 }, false).unwrap_err();
    assert!(error.to_string().contains("dense linears only"), "{error}");
    assert!(parameter_census(&config).is_err());
}
