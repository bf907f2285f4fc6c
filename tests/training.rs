//! Training through burn-train's Learner: the loss falls, resume is exact, weights round-trip.

mod common;

use burn::prelude::*;
use burn_memwall_models::Error;
use burn_memwall_models::checkpoint::{load_safetensors, save_safetensors};
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind};
use burn_memwall_models::training::{
    Artifacts, RunConfig, Stack, StepOptimizer, TrainReport, TrainingConfig, train,
};

fn model_config() -> LmConfig {
    LmConfig::new(256, 64, 2, 4, 2, 128, 64)
}

fn run_config(epochs: usize) -> RunConfig {
    let training = TrainingConfig::new()
        .with_seq_len(32)
        .with_batch_size(8)
        .with_epochs(epochs)
        .with_max_steps_per_epoch(Some(12))
        // Of the corpus' 6 validation batches.
        .with_max_validation_steps(Some(3))
        // A schedule that moves in every epoch, so that a resume that restarted it would not
        // continue exactly.
        .with_learning_rate(1e-2)
        .with_warmup_steps(4)
        .with_decay_steps(28)
        .with_final_learning_rate(1e-3);
    RunConfig::new(model_config(), training)
}

fn corpus_tokens() -> Vec<u32> {
    TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap()
}

/// (train, validation) loss of each epoch; speeds differ between runs, losses must not.
fn losses(report: &TrainReport) -> Vec<(f64, f64)> {
    report
        .epochs
        .iter()
        .map(|e| (e.train_loss, e.valid_loss))
        .collect()
}

fn run(
    config: &RunConfig,
    device: &Device,
    artifacts: &Artifacts,
    resume: bool,
) -> Result<TrainReport, Error> {
    train(config, &corpus_tokens(), device, artifacts, resume, true)
}

#[test]
fn loss_falls_well_below_uniform_and_resume_continues_exactly() {
    // Weights are drawn lazily from the backend's global RNG: a test that ran beside this one
    // could draw between a seed and the weights it was meant for.
    let _turn = common::take_turn();
    for device in common::devices() {
        let uninterrupted_dir = common::temp_dir();
        let full = run(
            &run_config(3),
            &device,
            &Artifacts::new(uninterrupted_dir.path()),
            false,
        )
        .unwrap();
        assert_eq!(full.epochs.len(), 3);
        let uniform = (256f64).ln();
        let last = full.epochs[2];
        assert!(full.epochs[0].train_loss < uniform, "{:?}", full.epochs);
        assert!(
            last.train_loss < 0.6 * uniform,
            "train loss {} after 36 steps on {device:?}",
            last.train_loss
        );
        assert!(
            last.valid_loss < 0.6 * uniform,
            "valid loss {} after 36 steps on {device:?}",
            last.valid_loss
        );
        assert!(last.train_tokens_per_s > 0.0);

        let interrupted_dir = common::temp_dir();
        let artifacts = Artifacts::new(interrupted_dir.path());
        let first = run(&run_config(2), &device, &artifacts, false).unwrap();
        assert_eq!(
            losses(&first),
            losses(&full)[..2],
            "same seed, same first epochs"
        );
        let resumed = run(&run_config(3), &device, &artifacts, true).unwrap();
        assert_eq!(
            resumed.epochs.len(),
            1,
            "only the remaining epoch is trained"
        );
        // Flex is deterministic; Cube autotuning may pick other kernels in another run.
        let tolerance = if format!("{device:?}").contains("Flex") {
            1e-6
        } else {
            1e-3
        };
        for (got, want) in [
            (resumed.epochs[0].train_loss, last.train_loss),
            (resumed.epochs[0].valid_loss, last.valid_loss),
        ] {
            assert!(
                (got - want).abs() <= tolerance * want,
                "resumed {got} vs uninterrupted {want} on {device:?}"
            );
        }
        assert!(artifacts.weights().exists());

        let validation_log =
            std::fs::read_to_string(artifacts.dir().join("valid/epoch-3/Loss.log")).unwrap();
        assert_eq!(
            validation_log
                .lines()
                .filter(|line| !line.ends_with(",final"))
                .count(),
            3,
            "validation is capped at 3 batches:\n{validation_log}"
        );

        // The curve of the resumed run holds its whole history, step by step.
        let curve = artifacts.loss_curve().unwrap();
        let uninterrupted = Artifacts::new(uninterrupted_dir.path())
            .loss_curve()
            .unwrap();
        assert_eq!(curve.train.len(), 36, "3 epochs of 12 steps");
        assert_eq!(
            curve
                .valid
                .iter()
                .map(|&(step, _)| step)
                .collect::<Vec<_>>(),
            [12, 24, 36]
        );
        for ((step, got), (want_step, want)) in curve
            .train
            .iter()
            .chain(&curve.valid)
            .zip(uninterrupted.train.iter().chain(&uninterrupted.valid))
        {
            assert_eq!(step, want_step);
            assert!(
                (got - want).abs() <= tolerance * want,
                "step {step}: resumed {got} vs uninterrupted {want} on {device:?}"
            );
        }
        for (epoch, record) in full.epochs.iter().enumerate() {
            let steps = &uninterrupted.train[12 * epoch..12 * (epoch + 1)];
            let mean = steps.iter().map(|&(_, loss)| loss).sum::<f64>() / 12.0;
            assert!(
                (mean - record.train_loss).abs() <= 1e-6 * record.train_loss,
                "epoch {}: mean of the steps {mean} vs the epoch's loss {}",
                record.epoch,
                record.train_loss
            );
            assert_eq!(uninterrupted.valid[epoch].1, record.valid_loss);
        }
    }
}

/// AdamW applied during backward trains through the Learner exactly as the standard step does,
/// and its run resumes exactly from the Learner's checkpoints (the optimizer record is the same).
#[test]
fn in_backward_training_matches_adamw_and_resumes_exactly() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let in_backward = |epochs| {
        let mut config = run_config(epochs);
        config.training.optimizer = StepOptimizer::InBackwardAdamW;
        config
    };
    let standard_dir = common::temp_dir();
    let standard = run(
        &run_config(2),
        &device,
        &Artifacts::new(standard_dir.path()),
        false,
    )
    .unwrap();
    let dir = common::temp_dir();
    let artifacts = Artifacts::new(dir.path());
    let first = run(&in_backward(2), &device, &artifacts, false).unwrap();
    let counts = first
        .model
        .in_backward()
        .expect("the run trained in backward")
        .last_step();
    assert!(
        counts.in_backward == common::parameters(&first.model).len() && counts.after_backward == 0,
        "{counts:?}"
    );
    for ((got_train, got_valid), (want_train, want_valid)) in
        losses(&first).into_iter().zip(losses(&standard))
    {
        assert!(
            (got_train - want_train).abs() <= 1e-5 * want_train
                && (got_valid - want_valid).abs() <= 1e-5 * want_valid,
            "in backward ({got_train}, {got_valid}) vs standard ({want_train}, {want_valid})"
        );
    }

    let uninterrupted_dir = common::temp_dir();
    let uninterrupted = run(
        &in_backward(3),
        &device,
        &Artifacts::new(uninterrupted_dir.path()),
        false,
    )
    .unwrap();
    let resumed = run(&in_backward(3), &device, &artifacts, true).unwrap();
    assert_eq!(losses(&resumed), losses(&uninterrupted)[2..]);
}

/// Ternary and counter linears train through the Learner with `InBackward` (the counter's own
/// update inside backward, at the step's learning rate; the ternary latent weights exactly as
/// the standard step trains them), the loss falls, a resumed run continues exactly (the
/// counters, scales, statistics and step are in the checkpoint), and the exported weights load
/// back bit-exactly.
#[test]
fn quantized_linears_train_resume_and_export_exactly() {
    let _turn = common::take_turn();
    let device = Device::flex();
    for linear in [LinearKind::Ternary, LinearKind::Counter] {
        let config = |epochs| {
            let mut config = run_config(epochs);
            config.model.linear = linear;
            config.training.optimizer = StepOptimizer::InBackwardAdamW;
            config
        };
        let uninterrupted_dir = common::temp_dir();
        let full = run(
            &config(3),
            &device,
            &Artifacts::new(uninterrupted_dir.path()),
            false,
        )
        .unwrap();
        let uniform = (256f64).ln();
        let last = full.epochs[2];
        assert!(
            last.valid_loss < 0.7 * uniform,
            "{linear:?}: valid loss {} after 36 steps",
            last.valid_loss
        );
        let dir = common::temp_dir();
        let artifacts = Artifacts::new(dir.path());
        let first = run(&config(2), &device, &artifacts, false).unwrap();
        let resumed = run(&config(3), &device, &artifacts, true).unwrap();
        assert_eq!(losses(&resumed), losses(&full)[2..], "{linear:?}");
        if linear == LinearKind::Ternary {
            // Routed through InBackward, the latent weights get the standard step's updates.
            let mut standard = config(2);
            standard.training.optimizer = StepOptimizer::AdamW;
            let standard_dir = common::temp_dir();
            let standard = run(
                &standard,
                &device,
                &Artifacts::new(standard_dir.path()),
                false,
            )
            .unwrap();
            for (got, want) in losses(&first).into_iter().zip(losses(&standard)) {
                assert!(
                    (got.0 - want.0).abs() <= 1e-5 * want.0
                        && (got.1 - want.1).abs() <= 1e-5 * want.1,
                    "in backward {got:?} vs standard {want:?}"
                );
            }
        }

        let exported = uninterrupted_dir.path().join("model.safetensors");
        let loaded = load_safetensors(config(3).model.init(&device).unwrap(), &exported).unwrap();
        let tokens = Tensor::<2, Int>::from_data([[1, 7, 42, 9, 200]], &device);
        assert_eq!(
            loaded.forward(tokens.clone()).into_data(),
            full.model.forward(tokens).into_data(),
            "{linear:?}"
        );
    }
}

#[test]
fn safetensors_export_round_trips_bit_exactly() {
    let _turn = common::take_turn();
    for device in common::devices() {
        let dir = common::temp_dir();
        let path = dir.path().join("model.safetensors");
        device.seed(1);
        let original = model_config().init(&device).unwrap();
        save_safetensors(&original, &path).unwrap();
        device.seed(2);
        let fresh = model_config().init(&device).unwrap();
        assert_ne!(
            common::parameters(&fresh)[0],
            common::parameters(&original)[0],
            "different seeds, different weights"
        );

        let loaded = load_safetensors(fresh, &path).unwrap();
        let (want, got) = (common::parameters(&original), common::parameters(&loaded));
        assert_eq!(want.len(), got.len());
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(
                w.as_bytes(),
                g.as_bytes(),
                "bit-exact round trip on {device:?}"
            );
        }
        let saved = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(saved, 1, "no temporary file is left behind");
    }
}

#[test]
fn weights_or_checkpoints_from_another_config_are_refused() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let dir = common::temp_dir();
    let path = dir.path().join("model.safetensors");
    save_safetensors(&model_config().init(&device).unwrap(), &path).unwrap();
    let mut wider = model_config();
    wider.d_ff = 96;
    let wider = wider.init(&device).unwrap();
    let error = load_safetensors(wider, &path).unwrap_err();
    assert!(matches!(error, Error::Checkpoint { .. }), "{error}");
    assert!(error.to_string().contains("model.safetensors"), "{error}");
    let error = load_safetensors(
        model_config().init(&device).unwrap(),
        dir.path().join("none.safetensors"),
    )
    .unwrap_err();
    assert!(matches!(error, Error::Io { .. }), "{error}");

    let artifacts = Artifacts::new(dir.path().join("run"));
    run(&run_config(1), &device, &artifacts, false).unwrap();
    let mut other = run_config(2);
    other.model.d_ff = 96;
    let error = run(&other, &device, &artifacts, true).unwrap_err();
    assert!(error.to_string().contains("d_ff: 128 → 96"), "{error}");
    // A schedule or optimizer changed on a resume would silently train another run.
    let mut other = run_config(2);
    other.training.warmup_steps = 2;
    let error = run(&other, &device, &artifacts, true).unwrap_err();
    assert!(error.to_string().contains("warmup_steps: 4 → 2"), "{error}");
    let mut other = run_config(2);
    other.training.optimizer = StepOptimizer::InBackwardAdamW;
    let error = run(&other, &device, &artifacts, true).unwrap_err();
    assert!(error.to_string().contains("optimizer"), "{error}");

    let error = run(
        &run_config(2),
        &device,
        &Artifacts::new(dir.path().join("empty")),
        true,
    )
    .unwrap_err();
    assert!(matches!(error, Error::Checkpoint { .. }), "{error}");
}

/// Trains a fresh Flex run of `run_config(1)` changed by `edit`, expecting an error; returns it
/// with the artifacts folder the run used.
fn failed_run(edit: impl FnOnce(&mut RunConfig)) -> (Error, Artifacts, tempfile::TempDir) {
    let dir = common::temp_dir();
    let artifacts = Artifacts::new(dir.path());
    let mut config = run_config(1);
    edit(&mut config);
    let error = run(&config, &Device::flex(), &artifacts, false).unwrap_err();
    (error, artifacts, dir)
}

#[test]
fn bad_training_inputs_are_clear_errors() {
    let _turn = common::take_turn();
    let (error, ..) = failed_run(|c| c.training.seq_len = 65);
    assert!(
        error
            .to_string()
            .contains("sequence length 65 exceeds the model's context of 64"),
        "{error}"
    );
    let (error, ..) = failed_run(|c| c.model.vocab_size = 100);
    assert!(
        matches!(
            error,
            Error::TokenOutOfRange {
                vocab_size: 100,
                ..
            }
        ),
        "{error}"
    );
}

#[test]
fn a_diverged_run_is_an_error_not_a_saved_model() {
    let _turn = common::take_turn();
    // Burn's warm-up and decay take rates up to 1 only: a constant rate diverges.
    let (error, artifacts, _dir) = failed_run(|c| {
        c.training.learning_rate = 1e30;
        c.training.warmup_steps = 0;
        c.training.decay_steps = 0;
    });
    assert!(error.to_string().contains("diverged"), "{error}");
    assert!(
        !artifacts.weights().exists(),
        "no weights are exported from a diverged run"
    );
}

#[test]
fn a_fresh_run_clears_the_checkpoints_of_an_earlier_one() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let dir = common::temp_dir();
    let artifacts = Artifacts::new(dir.path());
    run(&run_config(2), &device, &artifacts, false).unwrap();
    assert_eq!(artifacts.last_complete_epoch(), Some(2));
    run(&run_config(1), &device, &artifacts, false).unwrap();
    assert_eq!(
        artifacts.last_complete_epoch(),
        Some(1),
        "epoch 2 of the old run must not be resumable"
    );
}

/// Each named stack sets the switches its documentation names.
#[test]
fn stacks_resolve_to_their_switches() {
    use AttentionKind::{Burn as BurnAttention, Flash};
    use LossKind::{Burn as FullLogits, Fused};
    let want = [
        (
            "baseline",
            BurnAttention,
            FullLogits,
            BlockKind::Standard,
            LinearKind::Dense,
            StepOptimizer::AdamW,
        ),
        (
            "memwall",
            Flash,
            Fused,
            BlockKind::Reversible,
            LinearKind::Dense,
            StepOptimizer::InBackwardFusedAdamW,
        ),
        (
            "memwall-sgd",
            Flash,
            Fused,
            BlockKind::Reversible,
            LinearKind::Dense,
            StepOptimizer::InBackwardSgd,
        ),
        (
            "memwall-counter",
            Flash,
            Fused,
            BlockKind::Reversible,
            LinearKind::CounterAll,
            StepOptimizer::InBackwardFusedAdamW,
        ),
    ];
    assert_eq!(Stack::ALL.len(), want.len());
    for (name, attention, loss, blocks, linear, optimizer) in want {
        let stack = Stack::from_name(name).unwrap();
        assert_eq!(stack.name(), name);
        // From a config whose switches are all the other way, so that each one is set.
        let mut config = model_config()
            .with_attention(if attention == Flash {
                BurnAttention
            } else {
                Flash
            })
            .with_loss(if loss == Fused { FullLogits } else { Fused })
            .with_blocks(if blocks == BlockKind::Standard {
                BlockKind::Reversible
            } else {
                BlockKind::Standard
            })
            .with_linear(LinearKind::Ternary);
        assert_eq!(stack.apply(&mut config), optimizer, "{name}");
        assert_eq!(
            (config.attention, config.loss, config.blocks, config.linear),
            (attention, loss, blocks, linear),
            "{name}"
        );
    }
    let error = Stack::from_name("fast").unwrap_err().to_string();
    assert!(
        error.contains("unknown stack `fast`") && error.contains("memwall-counter"),
        "{error}"
    );
}

/// The default stack of `train` (everything on, full-width reversible blocks) learns the corpus
/// as the baseline does: after the same 36 steps its validation loss is well below uniform.
#[test]
fn the_memwall_stack_learns() {
    let _turn = common::take_turn();
    for device in common::devices() {
        let mut config = run_config(3);
        config.training.optimizer = Stack::Memwall.apply(&mut config.model);
        let dir = common::temp_dir();
        let report = run(&config, &device, &Artifacts::new(dir.path()), false).unwrap();
        let last = report.epochs[2];
        assert!(
            last.valid_loss < 0.7 * (256f64).ln(),
            "memwall stack on {device:?}: valid loss {} after 36 steps",
            last.valid_loss
        );
    }
}

/// One epoch of `model` through burn-train's `SupervisedTraining` with the `InBackwardTraining`
/// strategy, after `configure` has had its say on the builder.
fn launch_in_backward_training(
    device: &Device,
    model: burn_memwall_models::lm::LanguageModel,
    configure: impl FnOnce(
        burn::train::SupervisedTraining<burn_memwall_models::lm::LanguageModel>,
    )
        -> burn::train::SupervisedTraining<burn_memwall_models::lm::LanguageModel>,
) -> burn::train::LearningResult<burn_memwall_models::lm::LanguageModel> {
    use std::sync::Arc;

    use burn::data::dataloader::DataLoaderBuilder;
    use burn::train::{Learner, SupervisedTraining, TrainingStrategy};
    use burn_memwall::optim::InBackwardTraining;
    use burn_memwall_models::data::{LmBatcher, TokenWindows};

    let (train, valid) = TokenWindows::split(&corpus_tokens(), 32, 256, 0.1).unwrap();
    let loader = |dataset| {
        DataLoaderBuilder::new(LmBatcher)
            .batch_size(8)
            .build(dataset)
    };
    let optimizer = StepOptimizer::InBackwardFusedAdamW.init(0.0);
    let strategy = InBackwardTraining::new(device.clone(), optimizer.clone(), 1e-2);
    let dir = common::temp_dir();
    let builder = SupervisedTraining::new(dir.path(), loader(train), loader(valid))
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .with_application_logger(None)
        .renderer(Box::new(
            burn_memwall_models::training::ProgressRenderer::new(32, true).0,
        ))
        .num_epochs(1);
    configure(builder).launch(Learner::new(model, optimizer, 1e-2))
}

/// `InBackwardTraining` steps the model it takes out of the Learner; a clone the caller kept
/// shares the weights' storage, so the in-place updates must copy it instead of writing into
/// it: the clone keeps its values while the trained model moves away from them.
#[test]
fn a_clone_of_the_model_held_elsewhere_is_left_as_it_was() {
    use burn_memwall::optim::InBackward;

    let _turn = common::take_turn();
    for device in common::devices() {
        device.seed(5);
        let model = model_config()
            .init(&device.clone().autodiff())
            .unwrap()
            .with_in_backward(Some(InBackward::new()));
        let kept = model.clone();
        let before = common::parameters(&kept);
        let result = launch_in_backward_training(&device, model, |builder| builder);
        assert!(result.error.is_none(), "{:?}", result.error);
        let after = common::parameters(&kept);
        let trained = common::parameters(&result.model);
        assert_eq!(after, before, "{device:?}: the kept clone changed");
        assert_ne!(trained, before, "{device:?}: the run trained nothing");
    }
}

/// `InBackwardTraining` writes its own checkpoints, one tensor at a time: given burn-train's
/// checkpointers too, it refuses to run rather than have them copy the whole state.
#[test]
#[should_panic(expected = "InBackwardTraining::with_checkpoints")]
fn in_backward_training_refuses_the_learners_checkpointers() {
    let device = Device::flex();
    let model = model_config().init(&device.clone().autodiff()).unwrap();
    launch_in_backward_training(&device, model, |builder| {
        builder.with_default_checkpointers()
    });
}
