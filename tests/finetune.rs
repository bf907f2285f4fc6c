//! Fine-tuning a Llama checkpoint through the Learner with LoRA (the project's `train --from
//! DIR --lora RANK`): only the adapters train, they are exported alone and merged, the merged
//! model is exported as a Llama checkpoint again, and the run resumes exactly.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use burn::prelude::*;
use burn::store::ModuleSnapshot;
use burn_memwall_models::Error;
use burn_memwall_models::data::{Corpus, DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::llama::{llama_config, load_llama};
use burn_memwall_models::lm::{
    AttentionKind, BlockKind, LanguageModel, LinearKind, LoraConfig, LossKind, load_adapters,
};
use burn_memwall_models::pretrained::Pretrained;
use burn_memwall_models::training::{
    Artifacts, RunConfig, Start, StepOptimizer, TrainReport, TrainingConfig, train,
};

/// A copy of the GQA fixture (vocabulary 64) with a character-level `tokenizer.json` for it:
/// the fixture holds no tokenizer.
fn base_checkpoint() -> tempfile::TempDir {
    let dir = common::temp_dir();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/gqa");
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(file), dir.path().join(file)).unwrap();
    }
    write_tokenizer(dir.path());
    dir
}

/// A character-level `tokenizer.json` of 63 ids into `dir`.
fn write_tokenizer(dir: &Path) {
    let characters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n.,;:!?'-";
    let vocab: serde_json::Map<String, serde_json::Value> = std::iter::once("[UNK]".to_string())
        .chain(characters.chars().map(String::from))
        .enumerate()
        .map(|(id, token)| (token, id.into()))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

/// A LoRA fine-tune of `base` with flash attention, the fused loss and FusedAdamW in backward.
fn lora_run(base: &Path, epochs: usize) -> RunConfig {
    let model = llama_config(base)
        .unwrap()
        .with_attention(AttentionKind::Flash)
        .with_loss(LossKind::Fused);
    let training = TrainingConfig::new()
        .with_seq_len(24)
        .with_batch_size(4)
        .with_epochs(epochs)
        .with_max_steps_per_epoch(Some(4))
        .with_max_validation_steps(Some(2))
        .with_learning_rate(1e-2)
        .with_warmup_steps(3)
        .with_decay_steps(6)
        .with_optimizer(StepOptimizer::InBackwardFusedAdamW)
        .with_lora(Some(LoraConfig::new(4, 8.0)));
    RunConfig::new(model, training).with_base(Some(base.into()))
}

/// Trains `config` on the default corpus with the fixture's tokenizer.
fn run(config: &RunConfig, artifacts: &Artifacts, start: &Start) -> Result<TrainReport, Error> {
    let dir = common::temp_dir();
    write_tokenizer(dir.path());
    let tokenizer = TextTokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let corpus = Corpus::new(tokenizer, DEFAULT_CORPUS, 0.1).unwrap();
    train(config, &corpus, &Device::flex(), artifacts, start, true)
}

/// Every parameter's bytes by path.
fn by_path(model: &LanguageModel) -> BTreeMap<String, Vec<u8>> {
    model
        .collect(None, None, false)
        .into_iter()
        .map(|tensor| (tensor.name.clone(), tensor.to_bytes().unwrap().to_vec()))
        .collect()
}

fn logits(model: &LanguageModel) -> TensorData {
    let device = model.devices()[0].clone();
    let ids: Vec<i64> = (0..20).map(|i| (i * 7 + 3) % 64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, 20]), &device);
    model.forward(tokens).into_data()
}

#[test]
fn a_lora_fine_tune_trains_only_its_adapters_and_exports_them_merged_and_alone() {
    let _turn = common::take_turn();
    let base_dir = base_checkpoint();
    let config = lora_run(base_dir.path(), 1);
    let dir = common::temp_dir();
    let artifacts = Artifacts::new(dir.path());
    let report = run(&config, &artifacts, &Start::Fresh).unwrap();
    let last = report.epochs.last().unwrap();
    assert!(last.train_loss.is_finite() && last.valid_loss.is_finite());

    // The merged model: the norms, the embedding and the head are the base's, bit for bit;
    // every linear of the blocks moved.
    let base = load_llama(base_dir.path(), &Device::flex()).unwrap();
    let (before, after) = (by_path(&base), by_path(&report.model));
    assert!(before.keys().eq(after.keys()), "the same parameters");
    let linears = ["query", "key", "value", "output", "up", "gate", "down"];
    let adapted =
        |path: &str| path.starts_with("blocks.") && linears.iter().any(|l| path.contains(l));
    let moved: Vec<_> = before
        .keys()
        .filter(|path| before[*path] != after[*path])
        .cloned()
        .collect();
    let expected: Vec<_> = before
        .keys()
        .filter(|path| adapted(path))
        .cloned()
        .collect();
    assert_eq!(moved, expected, "what moved");
    assert_eq!(expected.len(), 2 * 7, "7 linears in each of 2 blocks");

    // The adapters alone, on the base with fresh adapters, compute what the merged model does.
    let fresh = base.with_lora(config.training.lora.as_ref().unwrap());
    let reloaded = load_adapters(fresh, &artifacts.adapters()).unwrap();
    // The adapted forward sums `x·W + s·(x·A)·B`, the merged one `x·(W + s·A·B)`: f32
    // rounding apart (about 2e-5 of a logit here).
    common::assert_close(
        "logits",
        &"adapters",
        1e-4,
        logits(&reloaded),
        logits(&report.model),
    );

    // The Llama export loads back as the merged model, with the base's tokenizer beside it.
    let exported = load_llama(&artifacts.llama_export(), &Device::flex()).unwrap();
    assert!(by_path(&exported) == after, "the Llama export, bit for bit");
    assert_eq!(
        std::fs::read(artifacts.llama_export().join("tokenizer.json")).unwrap(),
        std::fs::read(base_dir.path().join("tokenizer.json")).unwrap()
    );
    // As does the run's own export, through the same door as a Llama folder.
    let (own, _) = Pretrained::open(dir.path())
        .unwrap()
        .model(&Device::flex())
        .unwrap();
    assert!(by_path(&own) == after, "the run's export, bit for bit");
}

#[test]
fn a_lora_fine_tune_resumes_exactly() {
    let _turn = common::take_turn();
    let base_dir = base_checkpoint();
    let uninterrupted_dir = common::temp_dir();
    let uninterrupted = run(
        &lora_run(base_dir.path(), 2),
        &Artifacts::new(uninterrupted_dir.path()),
        &Start::Fresh,
    )
    .unwrap();
    let dir = common::temp_dir();
    let artifacts = Artifacts::new(dir.path());
    run(&lora_run(base_dir.path(), 1), &artifacts, &Start::Fresh).unwrap();
    let resumed = run(&lora_run(base_dir.path(), 2), &artifacts, &Start::resume()).unwrap();
    let losses = |report: &TrainReport| {
        report
            .epochs
            .iter()
            .map(|e| (e.train_loss, e.valid_loss))
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(&resumed), losses(&uninterrupted)[1..]);
    assert_eq!(by_path(&resumed.model), by_path(&uninterrupted.model));
    let adapters = |dir: &Path| {
        let fresh = load_llama(base_dir.path(), &Device::flex())
            .unwrap()
            .with_lora(&LoraConfig::new(4, 8.0));
        by_path(&load_adapters(fresh, &Artifacts::new(dir).adapters()).unwrap())
    };
    assert!(
        adapters(dir.path()) == adapters(uninterrupted_dir.path()),
        "the adapters"
    );
}

#[test]
fn a_fine_tune_that_would_change_the_model_is_refused() {
    let _turn = common::take_turn();
    let base_dir = base_checkpoint();
    let dir = common::temp_dir();
    let refused = |edit: &dyn Fn(&mut RunConfig)| {
        let mut config = lora_run(base_dir.path(), 1);
        edit(&mut config);
        let error = run(&config, &Artifacts::new(dir.path()), &Start::Fresh).unwrap_err();
        assert!(!Artifacts::new(dir.path()).holds_run(), "nothing written");
        error.to_string()
    };
    let error = refused(&|config| config.model.blocks = BlockKind::Reversible);
    assert!(
        error
            .contains("but for attention, loss and savers (blocks: \"Standard\" → \"Reversible\")"),
        "{error}"
    );
    let error = refused(&|config| config.model.d_ff = 64);
    assert!(error.contains("d_ff: 48 → 64"), "{error}");
    let error = refused(&|config| {
        config.model.linear = LinearKind::Ternary;
        config.base = None;
    });
    assert!(error.contains("LoRA adapts dense linears"), "{error}");
    let error = refused(&|config| config.training.lora = Some(LoraConfig::new(0, 8.0)));
    assert!(error.contains("LoRA needs a positive rank"), "{error}");

    // A resume names the base it started from.
    let artifacts = Artifacts::new(dir.path());
    run(&lora_run(base_dir.path(), 1), &artifacts, &Start::Fresh).unwrap();
    let other = base_checkpoint();
    let error = run(&lora_run(other.path(), 2), &artifacts, &Start::resume())
        .unwrap_err()
        .to_string();
    assert!(error.contains("was started from"), "{error}");
}
