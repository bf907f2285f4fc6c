//! Hugging Face Llama-family checkpoints as the reference LM: `config.json` with
//! `model.safetensors`, or with its shards and their `model.safetensors.index.json`, as
//! `LlamaForCausalLM.save_pretrained` writes them; and back ([`save_llama`]).
//!
//! The LM's rotary embedding (Burn's `RotaryEncoding`) rotates each head's features in
//! adjacent pairs `(2m, 2m + 1)`; Llama's rotates `(m, m + d_head/2)` ("rotate half"), at the
//! same frequency `m`. The import reorders each query and key head's output features so that
//! Llama's pairs become adjacent: both are reordered alike, so every attention score is the
//! same, and the values and outputs are untouched.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use burn::tensor::{DType, FloatDType};
use serde::Deserialize;

use crate::Error;
use crate::checkpoint::{in_precision, save_safetensors_with, write_atomically};
use crate::lm::{BlockKind, LanguageModel, LinearKind, LmConfig, MlpKind};
use crate::pretrained::Pretrained;

/// The fields of a Llama `config.json` that shape the model. Fields that would change the
/// computation in ways the LM does not have are read only to refuse them.
#[derive(Deserialize, Debug)]
struct LlamaConfig {
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    /// transformers before 5: the rotary base, and a scaling the LM does not implement.
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5: both in one object.
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

#[derive(Deserialize, Debug)]
struct RopeParameters {
    rope_theta: f64,
    #[serde(default)]
    rope_type: Option<String>,
}

impl LlamaConfig {
    /// The LM of this shape, or what it cannot express, by the field's name.
    fn to_lm(&self, path: &Path) -> Result<LmConfig, Error> {
        let refuse = |reason: String| {
            Err(Error::Checkpoint {
                path: path.into(),
                reason,
            })
        };
        if let Some(kind) = self.model_type.as_deref().filter(|kind| *kind != "llama") {
            return refuse(format!("model_type `{kind}`: only `llama` is imported"));
        }
        if let Some(act) = self.hidden_act.as_deref().filter(|act| *act != "silu") {
            return refuse(format!(
                "hidden_act `{act}`: the LM's MLP is SwiGLU (`silu`)"
            ));
        }
        if self.attention_bias || self.mlp_bias {
            return refuse("attention_bias or mlp_bias: the LM's linears have no bias".into());
        }
        let scaled = match &self.rope_parameters {
            Some(parameters) => parameters
                .rope_type
                .as_deref()
                .is_some_and(|kind| kind != "default"),
            None => self.rope_scaling.as_ref().is_some_and(|s| !s.is_null()),
        };
        if scaled {
            return refuse(
                "rope scaling (rope_scaling, or a rope_type other than `default`): not \
                 implemented by the LM's rotary embedding"
                    .into(),
            );
        }
        let d_head = self.hidden_size / self.num_attention_heads.max(1);
        if let Some(head_dim) = self.head_dim.filter(|&head_dim| head_dim != d_head) {
            return refuse(format!(
                "head_dim {head_dim} is not hidden_size / num_attention_heads = {d_head}"
            ));
        }
        let rope_theta = match &self.rope_parameters {
            Some(parameters) => parameters.rope_theta,
            None => self.rope_theta.unwrap_or(10_000.0),
        };
        let config = LmConfig::new(
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            self.intermediate_size,
            self.max_position_embeddings,
        )
        .with_mlp(MlpKind::SwiGlu)
        .with_tie_embeddings(self.tie_word_embeddings)
        .with_rope_theta(rope_theta as f32)
        .with_norm_eps(self.rms_norm_eps);
        config.validate().map_err(|error| Error::Checkpoint {
            path: path.into(),
            reason: error.to_string(),
        })?;
        Ok(config)
    }
}

/// The LM config of the Llama checkpoint in `dir` (its `config.json`).
///
/// # Errors
/// An unreadable `config.json`, or a model the LM cannot express (another `model_type`, biases,
/// an activation other than SiLU, rope scaling), naming the field.
pub fn llama_config(dir: &Path) -> Result<LmConfig, Error> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|error| Error::io(&path, error))?;
    let config: LlamaConfig = serde_json::from_str(&text).map_err(|error| Error::Checkpoint {
        path: path.clone(),
        reason: error.to_string(),
    })?;
    config.to_lm(&path)
}

/// The Llama checkpoint in `dir` as the reference LM on `device` (dense linears, standard
/// blocks; switch attention, loss or blocks afterwards as for any LM config).
///
/// # Errors
/// As [`llama_config`]; a missing, truncated or unreadable weights file or shard; a tensor
/// missing, unexpected or of another shape than the config says, naming it.
pub fn load_llama(dir: &Path, device: &Device) -> Result<LanguageModel, Error> {
    let config = llama_config(dir)?;
    Pretrained::Llama(dir.into()).load_weights(config.init(device)?, &config)
}

/// The weights of the Llama checkpoint in `dir`, of `config` ([`llama_config`]), loaded into
/// `model` in `float`: a model of that config, with any attention and loss switches (they do
/// not change the parameters).
pub(crate) fn load_llama_weights(
    model: LanguageModel,
    config: &LmConfig,
    dir: &Path,
    float: FloatDType,
) -> Result<LanguageModel, Error> {
    let mut model = model;
    let files = weight_files(dir)?;
    let mut missing: Option<BTreeSet<String>> = None;
    let mut unused = BTreeSet::new();
    for file in &files {
        if !file.exists() {
            return Err(Error::io(file, std::io::ErrorKind::NotFound.into()));
        }
        let fail = |reason: String| Error::Checkpoint {
            path: file.clone(),
            reason,
        };
        let mut store = renamed(SafetensorsStore::from_file(file), Naming::FromHuggingFace)
            .with_from_adapter(PyTorchToBurnAdapter)
            .skip_enum_variants(true)
            .allow_partial(true);
        let result = model
            .load_from(&mut store)
            .map_err(|error| fail(error.to_string()))?;
        if !result.errors.is_empty() {
            return Err(fail(format!("{:?}", result.errors)));
        }
        unused.extend(result.unused);
        let here: BTreeSet<String> = result.missing.into_iter().map(|(path, _)| path).collect();
        missing = Some(match missing {
            Some(before) => before.intersection(&here).cloned().collect(),
            None => here,
        });
    }
    let missing: Vec<_> = missing.unwrap_or_default().into_iter().collect();
    if !missing.is_empty() || !unused.is_empty() {
        return Err(Error::Checkpoint {
            path: dir.into(),
            reason: format!(
                "the weights do not match config.json: missing {missing:?}, unexpected {unused:?}"
            ),
        });
    }
    Ok(in_precision(model, Some(float)).map(&mut RotaryPairs::new(config.d_head(), true)))
}

/// Writes `model` of `config` into `dir` as a Hugging Face Llama checkpoint (`config.json`,
/// `model.safetensors`, written atomically), which [`load_llama`] and transformers'
/// `LlamaForCausalLM.from_pretrained` read back.
///
/// # Errors
/// A model that is not a Llama (a ReLU² MLP, quantised linears, reversible blocks), or a file
/// that cannot be written.
pub fn save_llama(model: &LanguageModel, config: &LmConfig, dir: &Path) -> Result<(), Error> {
    let not_llama = match (config.mlp, config.linear, config.blocks) {
        (MlpKind::SwiGlu, LinearKind::Dense, BlockKind::Standard) => None,
        (MlpKind::ReluSquared, _, _) => Some("a ReLU² MLP"),
        (_, LinearKind::Dense, _) => Some("reversible blocks"),
        _ => Some("quantised linears"),
    };
    if let Some(what) = not_llama {
        return Err(Error::Checkpoint {
            path: dir.into(),
            reason: format!("{what}: a Llama checkpoint has SwiGLU, dense, standard blocks"),
        });
    }
    std::fs::create_dir_all(dir).map_err(|error| Error::io(dir, error))?;
    let llama = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.d_head(),
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": torch_dtype(model)?,
    });
    let config_path = dir.join("config.json");
    write_atomically(&config_path, format!("{llama:#}\n").as_bytes())?;
    let exported = model
        .clone()
        .map(&mut RotaryPairs::new(config.d_head(), false));
    save_safetensors_with(&exported, &dir.join("model.safetensors"), |store| {
        renamed(store, Naming::ToHuggingFace)
            .with_to_adapter(BurnToPyTorchAdapter)
            .skip_enum_variants(true)
    })
}

/// transformers' name of the float type `model`'s weights are stored in.
fn torch_dtype(model: &LanguageModel) -> Result<&'static str, Error> {
    let dtype = model
        .collect(None, None, false)
        .first()
        .map(|weight| weight.dtype);
    match dtype {
        Some(DType::F32) => Ok("float32"),
        Some(DType::BF16) => Ok("bfloat16"),
        Some(DType::F16) => Ok("float16"),
        other => Err(Error::InvalidConfig(format!(
            "a Llama checkpoint's weights are f32, bf16 or f16, not {other:?}"
        ))),
    }
}

/// The weights files: the shards the index names, or the one `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok(vec![dir.join("model.safetensors")]);
    }
    #[derive(Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(&index).map_err(|error| Error::io(&index, error))?;
    let index_file: Index = serde_json::from_str(&text).map_err(|error| Error::Checkpoint {
        path: index.clone(),
        reason: error.to_string(),
    })?;
    let shards: BTreeSet<&String> = index_file.weight_map.values().collect();
    Ok(shards.into_iter().map(|shard| dir.join(shard)).collect())
}

/// The LM's module paths of Llama's tensors: those of every block (under `model.layers.{i}.`
/// and `blocks.{i}.`), then the others.
const BLOCK_NAMES: [(&str, &str); 9] = [
    ("self_attn.q_proj", "attention.query"),
    ("self_attn.k_proj", "attention.key"),
    ("self_attn.v_proj", "attention.value"),
    ("self_attn.o_proj", "attention.output"),
    ("mlp.gate_proj", "mlp.gate"),
    ("mlp.up_proj", "mlp.up"),
    ("mlp.down_proj", "mlp.down"),
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "mlp_norm"),
];
const MODEL_NAMES: [(&str, &str); 3] = [
    ("model.embed_tokens", "embedding"),
    ("model.norm", "norm"),
    ("lm_head", "head"),
];

/// Which way [`renamed`] maps names.
#[derive(Clone, Copy)]
enum Naming {
    /// Reading Hugging Face's names as the LM's paths.
    FromHuggingFace,
    /// Writing the LM's paths as Hugging Face's names.
    ToHuggingFace,
}

/// `store` with every name mapped as `naming` says; the norms' `weight`/`gamma` and the
/// linears' transposition are the PyTorch adapters'.
fn renamed(store: SafetensorsStore, naming: Naming) -> SafetensorsStore {
    let escape = |name: &str| name.replace('.', r"\.");
    let blocks = BLOCK_NAMES.iter().map(|&(hf, lm)| match naming {
        Naming::FromHuggingFace => (
            format!(r"^model\.layers\.(\d+)\.{}\.", escape(hf)),
            format!("blocks.$1.{lm}."),
        ),
        Naming::ToHuggingFace => (
            format!(r"^blocks\.(\d+)\.{}\.", escape(lm)),
            format!("model.layers.$1.{hf}."),
        ),
    });
    let others = MODEL_NAMES.iter().map(|&(hf, lm)| match naming {
        Naming::FromHuggingFace => (format!(r"^{}\.", escape(hf)), format!("{lm}.")),
        Naming::ToHuggingFace => (format!(r"^{}\.", escape(lm)), format!("{hf}.")),
    });
    blocks.chain(others).fold(store, |store, (from, to)| {
        store.with_key_remapping(from, to)
    })
}

/// Reorders the output features of every query and key weight `[d_model, heads · d_head]`
/// between Llama's rotate-half pairs `(m, m + d_head/2)` and the LM's adjacent pairs
/// `(2m, 2m + 1)`.
struct RotaryPairs {
    d_head: usize,
    /// Towards the LM's order (import), else towards Llama's (export).
    to_adjacent: bool,
    /// The modules entered, outermost first.
    path: Vec<String>,
}

impl RotaryPairs {
    fn new(d_head: usize, to_adjacent: bool) -> Self {
        Self {
            d_head,
            to_adjacent,
            path: Vec::new(),
        }
    }

    /// The feature of a head that feature `within` takes.
    fn source(&self, within: usize) -> usize {
        let half = self.d_head / 2;
        match (self.to_adjacent, within < half) {
            // Adjacent `2m` takes rotate-half `m`, `2m + 1` takes `m + half`.
            (true, _) => within / 2 + (within % 2) * half,
            // Rotate-half `m` takes adjacent `2m`, `m + half` takes `2m + 1`.
            (false, true) => 2 * within,
            (false, false) => 2 * (within - half) + 1,
        }
    }
}

impl ModuleMapper for RotaryPairs {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let rotated = self
            .path
            .windows(2)
            .any(|pair| pair[0] == "attention" && matches!(pair[1].as_str(), "query" | "key"));
        if D != 2 || !rotated {
            return param;
        }
        param.map(|weight| {
            let columns = weight.dims()[1];
            let order: Vec<i64> = (0..columns)
                .map(|feature| {
                    let (head, within) = (feature / self.d_head, feature % self.d_head);
                    (head * self.d_head + self.source(within)) as i64
                })
                .collect();
            let device = weight.device();
            let order = Tensor::<1, Int>::from_data(TensorData::new(order, [columns]), &device);
            weight.select(1, order)
        })
    }
}
