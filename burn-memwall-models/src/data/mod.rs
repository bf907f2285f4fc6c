//! Text → tokens → `[batch, seq]` batches.

mod corpus;
mod dataset;
mod text;
mod tokenizer;

pub use corpus::{Corpus, CorpusIdentity, split_text};
pub use dataset::{LmBatch, LmBatcher, TokenWindows};
pub use text::{DEFAULT_CORPUS, load_text};
pub use tokenizer::{END_OF_TEXT, TextTokenizer};
