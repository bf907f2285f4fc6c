//! Drop-in layers built on the memory-lean ops, each convertible from the Burn layer it replaces.
//!
//! - [`FlashMultiHeadAttention`]: Burn's multi-head attention on [`crate::ops::flash_attention`].

mod flash_mha;

pub use flash_mha::{FlashMhaError, FlashMhaInput, FlashMultiHeadAttention};
