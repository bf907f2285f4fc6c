//! The one error type of this crate: every message names what was wrong and with which value.

use std::path::PathBuf;

/// Everything that can go wrong before or around a training step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model configuration does not hold together.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// A token id is not below the model's vocabulary size.
    #[error(
        "token id {id} at position {position} is out of range for a vocabulary of {vocab_size}"
    )]
    TokenOutOfRange {
        id: u32,
        position: usize,
        vocab_size: usize,
    },
    /// A batch is longer than the model's context.
    #[error("sequence length {seq_len} exceeds the model's context of {max_seq_len} tokens")]
    SequenceTooLong { seq_len: usize, max_seq_len: usize },
    /// Input data that cannot be trained on (empty, too short, not UTF-8).
    #[error("data: {0}")]
    Data(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Tokenizer training, loading or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A checkpoint does not fit the model it is loaded into, or is unreadable.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    /// Training itself failed.
    #[error("training: {0}")]
    Training(String),
    /// Generation asked for something it cannot do (sampling settings, a prompt that does not
    /// fit), or met logits it cannot choose from.
    #[error("generation: {0}")]
    Generation(String),
    /// No stack's predicted step fits in the memory given.
    #[error("{0}")]
    DoesNotFit(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
