//! The swap changes the memory, not the training: Burn's model and the swapped one, trained
//! through the `Learner` from the same seed on the same data, lose the same at every step, and
//! each loads the other's trained weights and predicts the same next tokens through its
//! autoregressive cache; a step of the swapped one holds less at its peak, measured in separate
//! processes. With the encoder's reversible switch the swapped model trains and generates too.

use std::path::Path;
use std::process::Command;

use burn::nn::transformer::TransformerEncoderConfig;
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::logger::{FileMetricLogger, MetricLogger};
use burn::train::metric::NumericEntry;
use burn::train::metric::store::Split;
use burn_memwall_models::data::DEFAULT_CORPUS;
use text_generation::data::ByteTokenizer;
use text_generation::training::{ExperimentConfig, MODEL_FILE, Variant, train};

/// Held by each test that seeds the device: Flex has one generator per process.
static SEEDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    SEEDING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A tensor's values on the host.
fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

/// Each training step's loss, as burn-train logged it in `dir`.
fn logged_losses(dir: &Path) -> Vec<f64> {
    FileMetricLogger::new(dir)
        .read_numeric("Loss", 1, &Split::Train)
        .expect("burn-train logged the training loss")
        .into_iter()
        .filter(|entry| !matches!(entry, NumericEntry::Final(_)))
        .map(|entry| entry.current())
        .collect()
}

/// A small run: 2 pre-norm layers of width 32, dropout 0 (the swapped attention draws its
/// dropout from flash attention's generator, not from Burn's, so with dropout the two models
/// would drop different weights), an epoch of a few thousand bytes.
fn small_run() -> ExperimentConfig {
    let transformer = TransformerEncoderConfig::new(32, 64, 2, 2)
        .with_dropout(0.0)
        .with_norm_first(true);
    ExperimentConfig::new(transformer, AdamConfig::new())
        .with_max_seq_length(48)
        .with_batch_size(3)
        .with_learning_rate(0.05)
        .with_warmup_steps(4)
}

/// `variant` trained by `config` through the Learner on the embedded corpus: each step's loss
/// and the run's folder.
fn trained(
    config: &ExperimentConfig,
    variant: Variant,
    device: &Device,
) -> Result<(Vec<f64>, tempfile::TempDir), String> {
    let (train_text, valid_text) = (&DEFAULT_CORPUS[..2400], &DEFAULT_CORPUS[2400..2800]);
    let dir = tempfile::tempdir().unwrap();
    train(device, train_text, valid_text, config, variant, dir.path())?;
    Ok((logged_losses(dir.path()), dir))
}

#[test]
fn the_swapped_model_loses_what_burns_loses_at_every_step() {
    let _turn = take_turn();
    let config = small_run();
    let device = Device::flex();
    let run = |variant| trained(&config, variant, &device).unwrap();
    let (burn, burn_dir) = run(Variant::Burn);
    let (memwall, memwall_dir) = run(Variant::Memwall);

    assert!(burn.len() >= 15, "an epoch of {} steps", burn.len());
    assert_eq!(burn.len(), memwall.len(), "the same steps");
    for (step, (b, m)) in burn.iter().zip(&memwall).enumerate() {
        assert!(
            (b - m).abs() <= 1e-4,
            "step {step}: Burn's model lost {b}, the swapped one {m}"
        );
    }
    // The two runs computed apart: flash attention and the fused loss round differently.
    assert_ne!(burn, memwall, "the two runs must be two computations");
    let (first, last) = (burn[0], burn[burn.len() - 1]);
    assert!(last < first - 0.5, "it trains: {first} then {last}");

    for dir in [&burn_dir, &memwall_dir] {
        assert_same_next_tokens(&dir.path().join(MODEL_FILE), &config, &device);
    }
}

/// The swapped model with a reversible encoder (another function of the same parameters)
/// trains through the Learner and, loaded from its saved file, predicts through its cache one
/// token per call what it predicts from the whole prefix in one call; Burn's model refuses the
/// switch.
#[test]
fn the_reversible_swap_trains_and_generates() {
    let _turn = take_turn();
    let config = small_run().with_reversible(true);
    let device = Device::flex();
    let (losses, dir) = trained(&config, Variant::Memwall, &device).unwrap();
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < first - 0.5, "it trains: {first} then {last}");

    let model = config
        .memwall_model()
        .init(&device)
        .load_file(dir.path().join(MODEL_FILE));
    let tokens: Vec<i64> = ByteTokenizer
        .encode("ROMEO: Good")
        .into_iter()
        .map(|token| token as i64)
        .collect();
    let mut cache = model.new_autoregressive_cache();
    for len in 7..=tokens.len() {
        let input = |len| {
            Tensor::<2, Int>::from_data(TensorData::new(tokens[..len].to_vec(), [1, len]), &device)
        };
        let got = host(model.forward_next_token(input(len), &mut cache));
        let want =
            host(model.forward_next_token(input(len), &mut model.new_autoregressive_cache()));
        let largest = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (w.abs() + largest),
                "at {len} tokens, logit {i}: cached {g}, whole {w}"
            );
        }
    }

    let refused = trained(&config, Variant::Burn, &device).unwrap_err();
    assert!(
        refused.contains("reversible blocks are burn-memwall's"),
        "{refused}"
    );
}

/// Both models loaded from `model_file`, fed the same bytes (those Burn's model finds likeliest)
/// after a prompt, one per call through their autoregressive caches: the same logits each call.
fn assert_same_next_tokens(model_file: &Path, config: &ExperimentConfig, device: &Device) {
    let fresh = config.model().init(device);
    let burn = fresh.clone().load_file(model_file);
    let memwall = config.memwall_model().init(device).load_file(model_file);
    let (mut fresh_cache, mut burn_cache, mut cache) = (
        fresh.new_autoregressive_cache(),
        burn.new_autoregressive_cache(),
        memwall.new_autoregressive_cache(),
    );
    let mut sequence: Vec<i64> = ByteTokenizer
        .encode("ROMEO: ")
        .into_iter()
        .map(|token| token as i64)
        .collect();
    while sequence.len() < config.max_seq_length {
        let len = sequence.len();
        let input =
            Tensor::<2, Int>::from_data(TensorData::new(sequence.clone(), [1, len]), device);
        let want = burn.forward_next_token(input.clone(), &mut burn_cache);
        let got = host(memwall.forward_next_token(input.clone(), &mut cache));
        let untrained = host(fresh.forward_next_token(input, &mut fresh_cache));
        let largest = host(want.clone())
            .iter()
            .fold(1.0f32, |m, w| m.max(w.abs()));
        let mut loaded = false;
        for (i, (g, w)) in got.iter().zip(host(want.clone())).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (w.abs() + largest),
                "{} at {len} tokens, logit {i}: swapped {g}, Burn's {w}",
                model_file.display()
            );
            loaded |= (untrained[i] - w).abs() > 0.1;
        }
        assert!(loaded, "the file's weights are not a fresh model's");
        sequence.push(want.argmax(1).into_scalar::<i64>());
    }
}

/// `measure`'s peak for `variant` at `seq`, from its own process.
fn measured_peak(variant: &str, seq: usize) -> u64 {
    let output = Command::new(env!("CARGO_BIN_EXE_text-generation"))
        .args(["measure", "--device", "flex", "--model", variant])
        .args(["--seq", &seq.to_string(), "--batch", "1"])
        .args([
            "--d-model",
            "64",
            "--d-ff",
            "128",
            "--heads",
            "4",
            "--layers",
            "2",
        ])
        .output()
        .expect("the binary runs");
    assert!(
        output.status.success(),
        "measure {variant} at {seq}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = String::from_utf8(output.stdout).unwrap();
    let measured: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(measured["seq"], seq, "a full-length batch");
    measured["peak_bytes"].as_u64().unwrap()
}

#[test]
fn the_swapped_step_peaks_lower_and_the_gap_grows_with_the_sequence() {
    let mut ratios = Vec::new();
    for seq in [512, 2048] {
        let (burn, memwall) = (measured_peak("burn", seq), measured_peak("memwall", seq));
        eprintln!("seq {seq}: Burn's model {burn} B, swapped {memwall} B");
        ratios.push(burn as f64 / memwall as f64);
    }
    // Burn's attention holds [heads, seq, seq] scores per layer: 16 times more from 512 to
    // 2048, while the swapped model's step grows with the sequence only.
    assert!(ratios[0] > 1.5, "at 512 the swap saves: {ratios:?}");
    assert!(
        ratios[1] > 2.0 * ratios[0],
        "the saving grows with the sequence: {ratios:?}"
    );
}

/// Burn draws a parameter's initial value when it is first read, so the swapped model holds
/// Burn's model's weights from the same seed only if its forward pass reads them in Burn's
/// order: the two fresh models' first predictions agree.
#[test]
fn fresh_models_from_one_seed_predict_alike() {
    let _turn = take_turn();
    let config = ExperimentConfig::new(
        TransformerEncoderConfig::new(32, 64, 2, 2),
        AdamConfig::new(),
    )
    .with_max_seq_length(16);
    let device = Device::flex();
    let tokens =
        Tensor::<2, Int>::from_data(TensorData::new(vec![72i64, 105, 33], [1, 3]), &device);
    device.seed(7);
    let burn = config.model().init(&device);
    let want = burn.forward_next_token(tokens.clone(), &mut burn.new_autoregressive_cache());
    device.seed(7);
    let memwall = config.memwall_model().init(&device);
    let got = memwall.forward_next_token(tokens, &mut memwall.new_autoregressive_cache());
    let (want, got) = (host(want), host(got));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "logit {i}: swapped {g}, Burn's {w}"
        );
    }
}
