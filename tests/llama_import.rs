//! Hugging Face Llama checkpoints imported as the reference LM, against what transformers
//! computes with them: the fixtures under tests/fixtures/llama/ (a grouped-query model with its
//! own head, and a tied one with another rotary base) were written by
//! `scripts/llama_fixtures.py` with `LlamaForCausalLM`, with the logits of a fixed input and
//! the greedy continuation `generate` made.

mod common;

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::store::ModuleSnapshot;
use burn::tensor::FloatDType;
use burn_memwall_models::llama::{llama_config, load_llama, save_llama};
use burn_memwall_models::lm::{BlockKind, LanguageModel, LinearKind, MlpKind};
use serde::Deserialize;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(name)
}

/// What transformers computed (`expected.json`).
#[derive(Deserialize)]
struct Expected {
    input_ids: Vec<i64>,
    /// `[seq][vocab]`.
    logits: Vec<Vec<f32>>,
    greedy: Vec<i64>,
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(ids: &[i64], device: &Device) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), device)
}

/// Greedy decoding of `new` tokens after `prompt` through the generation cache.
fn greedy(model: &LanguageModel, prompt: &[i64], new: usize, device: &Device) -> Vec<i64> {
    let mut cache = model.new_generation_cache();
    let mut input = prompt.to_vec();
    (0..new)
        .map(|_| {
            let logits = model.next_logits(ids(&input, device), &mut cache);
            let token = logits.argmax(1).into_scalar::<i64>();
            input = vec![token];
            token
        })
        .collect()
}

#[test]
fn imported_llamas_compute_what_transformers_computes() {
    for device in common::devices() {
        for name in ["gqa", "tied"] {
            let want = expected(name);
            let model = load_llama(&fixture(name), &device).unwrap();
            let logits = model.forward(ids(&want.input_ids, &device));
            let got = logits.into_data().try_into_vec_as::<f32>().unwrap();
            let want_logits: Vec<f32> = want.logits.concat();
            let largest = want_logits.iter().fold(1.0f32, |m, w| m.max(w.abs()));
            for (i, (g, w)) in got.iter().zip(&want_logits).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * largest,
                    "{name} on {device:?}, logit {i}: {g}, transformers {w}"
                );
            }
            assert_eq!(
                greedy(&model, &want.input_ids, want.greedy.len(), &device),
                want.greedy,
                "{name} on {device:?}: the greedy continuation"
            );
        }
    }
}

/// The same weights in two shards with their index load as the single file does.
#[test]
fn a_sharded_checkpoint_loads_as_the_single_file() {
    let device = Device::flex();
    let want = expected("gqa");
    let logits = |name: &str| {
        let model = load_llama(&fixture(name), &device).unwrap();
        let logits = model.forward(ids(&want.input_ids, &device));
        logits.into_data().try_into_vec_as::<f32>().unwrap()
    };
    assert_eq!(logits("gqa-sharded"), logits("gqa"));
}

/// A copy of fixture `name` in a temporary folder, its `config.json` changed by `edit`.
fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&config_path, config.to_string()).unwrap();
    dir
}

/// The import's error for `dir`, as text.
fn refusal(dir: &Path) -> String {
    match load_llama(dir, &Device::flex()) {
        Ok(_) => panic!("{} was imported", dir.display()),
        Err(error) => {
            eprintln!("{error}");
            error.to_string()
        }
    }
}

#[test]
fn what_the_lm_cannot_express_is_refused_by_name() {
    let set = |field: &'static str, value: serde_json::Value| {
        move |config: &mut serde_json::Value| config[field] = value
    };
    for (dir, message) in [
        (
            edited("gqa", |config| {
                config["rope_parameters"]["rope_type"] = "linear".into()
            }),
            "rope scaling",
        ),
        (
            edited("gqa", set("attention_bias", true.into())),
            "attention_bias or mlp_bias",
        ),
        (
            edited("gqa", set("hidden_act", "gelu".into())),
            "hidden_act `gelu`",
        ),
        (
            edited("gqa", set("model_type", "qwen2".into())),
            "model_type `qwen2`",
        ),
        (
            edited("gqa", set("num_key_value_heads", 3.into())),
            "n_kv_heads = 3 does not divide n_heads = 4",
        ),
    ] {
        let error = refusal(dir.path());
        assert!(error.contains(message), "{error}");
        assert!(error.contains("config.json"), "names the file: {error}");
    }
}

#[test]
fn missing_truncated_or_mismatched_weights_are_refused_by_name() {
    let wider = edited("gqa", |config| config["intermediate_size"] = 64.into());
    let error = refusal(wider.path());
    assert!(error.contains("mlp"), "names the tensors: {error}");

    let truncated = edited("gqa", |_| {});
    let weights = truncated.path().join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let error = refusal(truncated.path());
    assert!(error.contains("model.safetensors"), "{error}");

    let missing_shard = edited("gqa-sharded", |_| {});
    std::fs::remove_file(
        missing_shard
            .path()
            .join("model-00002-of-00002.safetensors"),
    )
    .unwrap();
    let error = refusal(missing_shard.path());
    assert!(
        error.contains("model-00002-of-00002.safetensors"),
        "{error}"
    );
}

/// Every tensor of a safetensors file: its name, dtype and shape, and its bytes.
fn tensors(path: &Path) -> std::collections::BTreeMap<String, (String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let data = &bytes[8 + header_len..];
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, info)| {
            let offsets = &info["data_offsets"];
            let (start, end) = (
                offsets[0].as_u64().unwrap() as usize,
                offsets[1].as_u64().unwrap() as usize,
            );
            let layout = format!("{} {}", info["dtype"], info["shape"]);
            (name, (layout, data[start..end].to_vec()))
        })
        .collect()
}

/// Exporting an imported checkpoint writes transformers' tensors back bit for bit, under their
/// names and shapes, with a config that imports to the same model.
#[test]
fn an_imported_checkpoint_exports_bit_exactly() {
    let device = Device::flex();
    for name in ["gqa", "tied"] {
        let config = llama_config(&fixture(name)).unwrap();
        let model = load_llama(&fixture(name), &device).unwrap();
        let exported = tempfile::tempdir().unwrap();
        save_llama(&model, &config, exported.path()).unwrap();
        assert_eq!(
            tensors(&exported.path().join("model.safetensors")),
            tensors(&fixture(name).join("model.safetensors")),
            "{name}"
        );
        assert_eq!(llama_config(exported.path()).unwrap(), config, "{name}");
    }
}

/// Checkpoints are usually stored in bf16: one loads into a model that computes in f32 as its
/// weights widened exactly, and the export says its type.
#[test]
fn a_bf16_checkpoint_loads_into_an_f32_model() {
    struct Cast(FloatDType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            Param::initialized(param.id, param.val().cast(self.0))
        }
    }
    let device = Device::flex();
    let config = llama_config(&fixture("gqa")).unwrap();
    let model = load_llama(&fixture("gqa"), &device).unwrap();
    let bf16 = tempfile::tempdir().unwrap();
    save_llama(
        &model.clone().map(&mut Cast(FloatDType::BF16)),
        &config,
        bf16.path(),
    )
    .unwrap();
    let written = std::fs::read_to_string(bf16.path().join("config.json")).unwrap();
    assert!(
        written.contains("\"torch_dtype\": \"bfloat16\""),
        "{written}"
    );
    let loaded = load_llama(bf16.path(), &device).unwrap();
    let rounded = model
        .map(&mut Cast(FloatDType::BF16))
        .map(&mut Cast(FloatDType::F32));
    let data = |model: &LanguageModel| {
        model
            .collect(None, None, false)
            .into_iter()
            .map(|t| (t.name.clone(), t.dtype, t.to_bytes().unwrap().to_vec()))
            .collect::<Vec<_>>()
    };
    assert!(
        data(&loaded) == data(&rounded),
        "the weights, widened to f32"
    );
    let prompt = ids(&[1, 5, 9, 2], &device);
    // The same weights, held in other layouts: Flex may sum the products in another order.
    common::assert_close(
        "logits",
        &"bf16 checkpoint",
        1e-5,
        loaded.forward(prompt.clone()).into_data(),
        rounded.forward(prompt).into_data(),
    );
}

#[test]
fn a_model_that_is_no_llama_is_not_exported_as_one() {
    let device = Device::flex();
    let config = llama_config(&fixture("gqa")).unwrap();
    for (variant, what) in [
        (
            config.clone().with_blocks(BlockKind::Reversible),
            "reversible blocks",
        ),
        (config.clone().with_mlp(MlpKind::ReluSquared), "a ReLU² MLP"),
        (
            config.clone().with_linear(LinearKind::Ternary),
            "quantised linears",
        ),
    ] {
        let model = variant.init(&device).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let error = save_llama(&model, &variant, dir.path())
            .unwrap_err()
            .to_string();
        assert!(error.contains(what), "{error}");
        assert!(!dir.path().join("model.safetensors").exists());
    }
}
