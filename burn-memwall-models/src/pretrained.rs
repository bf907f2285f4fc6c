//! A trained model to fine-tune or to sample from: a Hugging Face Llama folder, or a folder
//! that a `train` run finished.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use burn_memwall::memory::weights_onto;

use crate::Error;
use crate::checkpoint::{in_precision, read_safetensors};
use crate::data::TextTokenizer;
use crate::llama::{llama_config, load_llama_weights};
use crate::lm::{LanguageModel, LmConfig};
use crate::training::Artifacts;

/// Where a trained model's config, weights and tokenizer are.
#[derive(Clone, Debug)]
pub enum Pretrained {
    /// `config.json`, `model.safetensors` (or its shards and their index), `tokenizer.json`.
    Llama(PathBuf),
    /// A run's `run.json`, `model.safetensors` and `tokenizer.json`.
    Run(Artifacts),
}

impl Pretrained {
    /// The model in `dir`: a run's folder if it holds `run.json`, a Llama folder if it holds
    /// `config.json`.
    ///
    /// # Errors
    /// A folder that holds neither.
    pub fn open(dir: &Path) -> Result<Self, Error> {
        if dir.join("run.json").exists() {
            Ok(Self::Run(Artifacts::new(dir)))
        } else if dir.join("config.json").exists() {
            Ok(Self::Llama(dir.into()))
        } else {
            Err(Error::Checkpoint {
                path: dir.into(),
                reason: "neither a run's folder (run.json) nor a Hugging Face Llama folder \
                         (config.json)"
                    .into(),
            })
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        match self {
            Self::Llama(dir) => dir,
            Self::Run(artifacts) => artifacts.dir(),
        }
    }

    /// The model's config (for a Llama folder: dense linears, standard blocks, Burn's attention
    /// and loss; switch attention and loss as for any config).
    ///
    /// # Errors
    /// As [`llama_config`]; for a run, a folder without a finished run.
    pub fn config(&self) -> Result<LmConfig, Error> {
        match self {
            Self::Llama(dir) => llama_config(dir),
            Self::Run(artifacts) => artifacts.trained_config(),
        }
    }

    /// The tokenizer, checked against `config`'s vocabulary.
    ///
    /// # Errors
    /// A missing or unreadable `tokenizer.json`, or one with ids the embedding has no row for.
    pub fn tokenizer(&self, config: &LmConfig) -> Result<TextTokenizer, Error> {
        let path = self.dir().join("tokenizer.json");
        let tokenizer = TextTokenizer::from_file(&path)?;
        tokenizer.check_fits(config.vocab_size, &path)?;
        Ok(tokenizer)
    }

    /// The trained weights loaded into `model`, a model of [`Self::config`] with any attention
    /// and loss switches, on its device. They are read and prepared (cast to the device's float
    /// type, a Llama's rotary rows reordered) in host memory, then moved onto the device as
    /// Burn keeps weights ([`weights_onto`]): read on the device itself, each weight and each
    /// of its preparations' copies took the pools' pages there.
    ///
    /// # Errors
    /// A missing, truncated or unreadable weights file, or tensors that do not fit the model.
    pub fn load_weights(
        &self,
        model: LanguageModel,
        config: &LmConfig,
    ) -> Result<LanguageModel, Error> {
        let device = model
            .devices()
            .into_iter()
            .next()
            .expect("a model has weights");
        let float = device.settings().float_dtype;
        let host = match device.is_autodiff() {
            true => Device::flex().autodiff(),
            false => Device::flex(),
        };
        let model = model.fork(&host);
        let loaded = match self {
            Self::Llama(dir) => load_llama_weights(model, config, dir, float)?,
            Self::Run(artifacts) => {
                in_precision(read_safetensors(model, &artifacts.weights())?, Some(float))
            }
        };
        Ok(weights_onto(loaded, &device))
    }

    /// The model on `device` with its tokenizer: for generation or evaluation.
    ///
    /// # Errors
    /// As [`Self::config`], [`Self::tokenizer`] and [`Self::load_weights`].
    pub fn model(&self, device: &Device) -> Result<(LanguageModel, TextTokenizer), Error> {
        let config = self.config()?;
        let tokenizer = self.tokenizer(&config)?;
        let model = self.load_weights(config.init(device)?, &config)?;
        Ok((model, tokenizer))
    }
}
