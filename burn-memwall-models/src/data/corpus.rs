//! A text made ready for training: split into its training and validation parts on the text
//! itself, each part tokenized on its own, and identified by content so that a resumed run can
//! tell it is given the same inputs.

use sha2::{Digest, Sha256};

use super::TextTokenizer;
use crate::Error;

/// Above this share of unknown tokens a corpus is refused: most of what the model would learn
/// is the unknown token.
const UNKNOWN_SHARE_REFUSED: f64 = 0.5;

/// The training and validation tokens of a text and the tokenizer that made them.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokenizer: TextTokenizer,
    train: Vec<u32>,
    valid: Vec<u32>,
    unknown_share: f64,
}

/// What a run was trained on, by content: saved in the run's `run.json`, compared on resume.
#[derive(burn::config::Config, Debug, PartialEq)]
pub struct CorpusIdentity {
    pub train_tokens: usize,
    pub valid_tokens: usize,
    /// SHA-256 of the training then the validation token ids (u32, little-endian).
    pub tokens_sha256: String,
    /// SHA-256 of the tokenizer's `tokenizer.json`.
    pub tokenizer_sha256: String,
}

/// The training part of `text` and the validation part after it: the cut is at
/// `1 − validation_fraction` of the bytes, moved on to the next whitespace (so that no word is
/// cut in two, which would tokenize as two other words), or to the next character where no
/// whitespace follows. A tokenizer trained
/// for a run should see only the training part (the validation loss would otherwise measure
/// text the vocabulary was fitted to).
///
/// # Errors
/// If `validation_fraction` is not in (0, 1).
pub fn split_text(text: &str, validation_fraction: f64) -> Result<(&str, &str), Error> {
    if !(validation_fraction > 0.0 && validation_fraction < 1.0) {
        return Err(Error::Data(format!(
            "validation fraction must be in (0, 1), got {validation_fraction}"
        )));
    }
    let mut cut = (text.len() as f64 * (1.0 - validation_fraction)) as usize;
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    if let Some(to_space) = text[cut..].find(char::is_whitespace) {
        cut += to_space;
    }
    Ok(text.split_at(cut))
}

impl Corpus {
    /// Splits `text` as [`split_text`] does and tokenizes both parts with `tokenizer`.
    ///
    /// # Errors
    /// If the fraction is out of range, the tokenizer has fewer than 2 ids, encoding fails, or
    /// more than half of the tokens are the tokenizer's unknown token.
    pub fn new(
        tokenizer: TextTokenizer,
        text: &str,
        validation_fraction: f64,
    ) -> Result<Self, Error> {
        let (train_text, valid_text) = split_text(text, validation_fraction)?;
        if tokenizer.vocab_size() < 2 {
            return Err(Error::Tokenizer(format!(
                "a vocabulary of {} id cannot be trained on: there is nothing to predict",
                tokenizer.vocab_size()
            )));
        }
        let train = tokenizer.encode(train_text)?;
        let valid = tokenizer.encode(valid_text)?;
        let unknown = match tokenizer.unknown_id()? {
            Some(unknown) => train
                .iter()
                .chain(&valid)
                .filter(|&&id| id == unknown)
                .count(),
            None => 0,
        };
        let unknown_share = unknown as f64 / (train.len() + valid.len()).max(1) as f64;
        if unknown_share > UNKNOWN_SHARE_REFUSED {
            return Err(Error::Tokenizer(format!(
                "{:.1}% of the text's {} tokens are the unknown token: this tokenizer does not \
                 fit this text",
                100.0 * unknown_share,
                train.len() + valid.len()
            )));
        }
        Ok(Self {
            tokenizer,
            train,
            valid,
            unknown_share,
        })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The tokens of the training part.
    pub fn train(&self) -> &[u32] {
        &self.train
    }

    /// The tokens of the validation part.
    pub fn valid(&self) -> &[u32] {
        &self.valid
    }

    /// The share of tokens that are the tokenizer's unknown token (0 for byte-level
    /// tokenizers, which have none); above a few percent the text is not what the tokenizer
    /// was made for.
    pub fn unknown_share(&self) -> f64 {
        self.unknown_share
    }

    /// The corpus' identity, as a run records it.
    ///
    /// # Errors
    /// If the tokenizer cannot be serialized.
    pub fn identity(&self) -> Result<CorpusIdentity, Error> {
        let mut tokens = Sha256::new();
        for id in self.train.iter().chain(&self.valid) {
            tokens.update(id.to_le_bytes());
        }
        Ok(CorpusIdentity {
            train_tokens: self.train.len(),
            valid_tokens: self.valid.len(),
            tokens_sha256: format!("{:x}", tokens.finalize()),
            tokenizer_sha256: format!("{:x}", Sha256::digest(self.tokenizer.to_json()?)),
        })
    }
}
