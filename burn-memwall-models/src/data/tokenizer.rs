//! Byte-level and BPE tokenizers, backed by Hugging Face's `tokenizers` crate.

use std::path::Path;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::Error;
use crate::checkpoint::write_atomically;

/// Marks document boundaries in trained BPE vocabularies.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// A text tokenizer; its [`vocab_size`](Self::vocab_size) is the embedding size a model needs.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextTokenizer(vocab_size = {})", self.vocab_size())
    }
}

impl TextTokenizer {
    /// One token per byte (256 ids): encodes any UTF-8 text exactly, needs no training data.
    pub fn byte_level() -> Self {
        Self::train_byte_level_bpe(std::iter::empty::<&str>(), 256, Vec::new())
            .expect("a byte alphabet always trains")
    }

    /// Learns a byte-level BPE of `vocab_size` ids (256 bytes, merges, and [`END_OF_TEXT`]) on `text`.
    pub fn train_bpe(text: &str, vocab_size: usize) -> Result<Self, Error> {
        if vocab_size <= 257 {
            return Err(Error::Tokenizer(format!(
                "a BPE vocabulary needs more than 257 ids (256 bytes + {END_OF_TEXT}), got {vocab_size}"
            )));
        }
        if text.trim().is_empty() {
            return Err(Error::Data("cannot train a tokenizer on empty text".into()));
        }
        Self::train_byte_level_bpe(
            text.lines(),
            vocab_size,
            vec![AddedToken::from(END_OF_TEXT, true)],
        )
    }

    fn train_byte_level_bpe<'a>(
        lines: impl Iterator<Item = &'a str> + Send,
        vocab_size: usize,
        special_tokens: Vec<AddedToken>,
    ) -> Result<Self, Error> {
        // No prefix space: decoding then gives back exactly the text that was encoded.
        let byte_level = ByteLevel::default().add_prefix_space(false);
        let mut inner = Tokenizer::new(BPE::default());
        inner
            .with_pre_tokenizer(Some(byte_level))
            .with_decoder(Some(byte_level));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab_size)
            .min_frequency(2)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(special_tokens)
            .build()
            .into();
        inner
            .train(&mut trainer, lines)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Self { inner })
    }

    /// Loads any Hugging Face `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::io(path, std::io::ErrorKind::NotFound.into()));
        }
        let inner = Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self { inner })
    }

    /// Writes `tokenizer.json` (to a temporary name first, so a crash leaves no half file).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        write_atomically(path.as_ref(), self.to_json()?.as_bytes())
    }

    /// The `tokenizer.json` text: what [`save`](Self::save) writes, and what a run's tokenizer
    /// hash is taken of.
    pub(crate) fn to_json(&self) -> Result<String, Error> {
        self.inner
            .to_string(true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The id that text outside the vocabulary becomes, if the model has one: read from the
    /// serialized model (`unk_token` for BPE, WordPiece and WordLevel, `unk_id` for Unigram),
    /// the one form every model kind shares. Byte-level BPEs have none: every byte is a token.
    pub(crate) fn unknown_id(&self) -> Result<Option<u32>, Error> {
        let json: serde_json::Value =
            serde_json::from_str(&self.to_json()?).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let model = &json["model"];
        if let Some(id) = model["unk_id"].as_u64() {
            return Ok(u32::try_from(id).ok());
        }
        Ok(model["unk_token"]
            .as_str()
            .and_then(|token| self.inner.token_to_id(token)))
    }

    /// Number of ids, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Checks that a model whose embedding has `vocab_size` rows covers every id of this
    /// tokenizer (`path` names it in the error). A Hugging Face checkpoint's embedding may have
    /// more rows than its tokenizer ids (padded to a round number); fewer would fail mid-run.
    pub fn check_fits(&self, vocab_size: usize, path: &Path) -> Result<(), Error> {
        if self.vocab_size() > vocab_size {
            return Err(Error::Tokenizer(format!(
                "{} holds {} ids, the model's vocabulary {vocab_size}",
                path.display(),
                self.vocab_size()
            )));
        }
        Ok(())
    }

    /// Token ids of `text`, without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }
}
