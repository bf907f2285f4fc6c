//! LoRA fine-tuning of the LM with Burn's own `Module::apply_lora`: the blocks' linears get
//! trainable factors, everything else is frozen; the factors save and load apart from the
//! frozen model.

use std::path::Path;

use burn::config::Config;
use burn::module::{Lora, Module, ParamGroup};
use burn::store::{ModuleSnapshot, PathFilter, SafetensorsStore};

use super::{LanguageModel, LinearKind, LmConfig};
use crate::Error;
use crate::checkpoint::{in_device_precision, save_safetensors_with};

/// Where Burn's traversal puts an adapter's factors: `<weight's path>.lora.{a,b}`.
const FACTOR_PATHS: &str = r"\.lora\.(a|b)$";
/// The parameters that stay without adapters: the embedding and the head (tied or not), whose
/// composed `[vocab, d_model]` weight would cost what LoRA saves.
const NOT_ADAPTED: &str = r"^(embedding|head)\.";

/// LoRA on the blocks' linears (attention projections and MLP): `W + (alpha / rank)·A·B` with
/// `A` `[d_input, rank]` drawn and `B` `[rank, d_output]` zero, so training starts from the
/// model as it was. Only `A` and `B` train; the norms, the embedding and the head are frozen.
#[derive(Config, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank of each adapter.
    pub rank: usize,
    /// Scales the adapters' product by `alpha / rank`.
    pub alpha: f64,
}

impl LoraConfig {
    /// Checks the numbers and that `model`'s linears are dense.
    ///
    /// # Errors
    /// A rank of 0, an alpha that is not finite and positive, or quantised linears.
    pub fn validate(&self, model: &LmConfig) -> Result<(), Error> {
        if self.rank == 0 || !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::InvalidConfig(format!(
                "LoRA needs a positive rank and a finite, positive alpha; got rank {}, alpha {}",
                self.rank, self.alpha
            )));
        }
        if model.linear != LinearKind::Dense {
            return Err(Error::InvalidConfig(format!(
                "LoRA adapts dense linears; the model's are {:?}",
                model.linear
            )));
        }
        Ok(())
    }

    /// The scalars the adapters of `model` train: `rank · (d_input + d_output)` per linear.
    pub fn trainable_parameters(&self, model: &LmConfig) -> usize {
        let per_block: usize = model
            .block_weights()
            .iter()
            .map(|weight| weight.adapter_elements(self.rank))
            .sum();
        model.n_layers * per_block
    }
}

impl LanguageModel {
    /// Freezes every parameter and gives each of the blocks' linears a LoRA adapter (drawn from
    /// the device's RNG). [`burn_memwall::nn::Routed::linear`] applies them without composing
    /// the weight; `Module::materialize` merges them.
    pub fn with_lora(self, config: &LoraConfig) -> Self {
        let blocks = ParamGroup::all()
            .exclude(ParamGroup::from_regex(NOT_ADAPTED).expect("the pattern is a valid regex"));
        self.apply_lora(Lora::new(config.rank, config.alpha).set_param_group(blocks))
    }
}

/// Writes the LoRA factors of `model` alone as a safetensors file (written atomically), under
/// Burn's paths (`blocks.0.attention.query.weight.lora.a`, …).
///
/// # Errors
/// A model without adapters, or a file that cannot be written.
pub fn save_adapters(model: &LanguageModel, path: &Path) -> Result<(), Error> {
    if adapter_paths(model).is_empty() {
        return Err(Error::Checkpoint {
            path: path.into(),
            reason: "the model has no LoRA adapters to save".into(),
        });
    }
    save_safetensors_with(model, path, |store| store.with_regex(FACTOR_PATHS))
}

/// Loads the factors [`save_adapters`] wrote into `model`, which must have adapters of the same
/// shapes on the same linears (build it with [`LanguageModel::with_lora`] of the same config).
///
/// # Errors
/// A missing or unreadable file; an adapter of the model the file lacks, a factor the model has
/// no adapter for, or a shape that differs, naming them.
pub fn load_adapters(model: LanguageModel, path: &Path) -> Result<LanguageModel, Error> {
    if !path.exists() {
        return Err(Error::io(path, std::io::ErrorKind::NotFound.into()));
    }
    let fail = |reason: String| Error::Checkpoint {
        path: path.into(),
        reason,
    };
    let expected = adapter_paths(&model);
    if expected.is_empty() {
        return Err(fail("the model has no LoRA adapters to load into".into()));
    }
    let mut model = model;
    let mut store = SafetensorsStore::from_file(path)
        .with_regex(FACTOR_PATHS)
        .allow_partial(true);
    let result = model
        .load_from(&mut store)
        .map_err(|error| fail(error.to_string()))?;
    let missing: Vec<_> = result
        .missing
        .iter()
        .map(|(path, _)| path)
        .filter(|path| expected.contains(path))
        .collect();
    if !result.errors.is_empty() || !missing.is_empty() || !result.unused.is_empty() {
        return Err(fail(format!(
            "does not match the model's adapters: errors {:?}, missing {missing:?}, \
             unexpected {:?}",
            result.errors, result.unused
        )));
    }
    Ok(in_device_precision(model))
}

/// The paths of `model`'s LoRA factors.
fn adapter_paths(model: &LanguageModel) -> Vec<String> {
    let factors = PathFilter::new().with_regex(FACTOR_PATHS);
    model
        .collect(Some(factors), None, false)
        .into_iter()
        .map(|factor| factor.name)
        .collect()
}
