//! The bit formats of burn-memwall's quantised weights and the draws of its attention dropout,
//! each in one home that owns its constants, its encode and its decode, on the host and
//! (feature `cube`) in the `#[cube]` helpers the kernels read them with:
//!
//! - [`counter`]: the counter synapse's 6-bit code `(t, c)`, 16 codes per 3 `u32` words, and
//!   its update rule (the reference the Flex path runs and the kernels mirror);
//! - [`ternary`]: an exported ternary weight, 2 bits each, 16 per word;
//! - [`dropout`]: attention dropout's keep-mask, a pure function of (seed, batch, head, query,
//!   key) that the backward regenerates;
//! - [`rounding`]: stochastic rounding of f32 values to bf16 or f16;
//! - [`saved_rows`]: activations kept for backward in 8 or 4 bits, rounded stochastically;
//! - [`moments`]: AdamW's moments kept in 8 or 4 bits, block by block;
//! - [`packing`]: how 8- and 4-bit codes are packed into `u32` words;
//! - [`hash`]: the counter-based hash they draw their random numbers from.
//!
//! [`PackedLayout`] names which of the two a packed weight row uses. This crate holds no Burn
//! types and imports nothing of burn-memwall: the kernels and the ops both read from it.
#![warn(missing_docs)]

pub mod counter;
pub mod dropout;
pub mod hash;
pub mod moments;
pub mod packing;
pub mod rounding;
pub mod saved_rows;
pub mod ternary;

use counter::CounterCode;

/// How the ternaries of a weight row are packed into `u32` words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedLayout {
    /// `t + 1` in 2 bits, 16 per word ([`ternary`]).
    Ternary,
    /// Counter-synapse codes, 6 bits each, 16 per 3 words ([`counter`]).
    Counter(CounterCode),
}

impl PackedLayout {
    /// Words that hold a row of `d_input` weights.
    pub fn words_per_row(self, d_input: usize) -> usize {
        match self {
            Self::Ternary => ternary::words_per_row(d_input),
            Self::Counter(_) => counter::words_per_row(d_input),
        }
    }

    /// `t` of weight `i` of the row packed in `words`.
    pub fn ternary(self, words: &[u32], i: usize) -> i32 {
        match self {
            Self::Ternary => ternary::ternary_at(words, i),
            Self::Counter(code) => code.ternary(counter::code_at(words, i)),
        }
    }

    /// `scale · t` of the row packed in `words`, into `out` (`[d_input]`).
    pub fn decode_row(self, words: &[u32], scale: f32, out: &mut [f32]) {
        match self {
            Self::Ternary => ternary::decode_row(words, scale, out),
            Self::Counter(code) => counter::decode_row(code, words, scale, out),
        }
    }
}
