//! The counter-based hash behind every random draw of burn-memwall's kernels: a pure function of
//! its input, so a draw needs no generator state, the backward pass regenerates the forward's
//! draws, and the host and every runtime draw the same numbers. The host side here, the
//! kernels' side in [`cube`].

/// The LCG step's multiplier in [`pcg_hash`].
const PCG_MULTIPLIER: u32 = 747_796_405;
/// The LCG step's increment in [`pcg_hash`].
const PCG_INCREMENT: u32 = 2_891_336_453;
/// The output permutation's multiplier in [`pcg_hash`].
const PCG_OUTPUT_MULTIPLIER: u32 = 277_803_737;

/// The PCG-RXS-M-XS output permutation of one LCG step (Jarzynski & Olano, "Hash Functions for
/// GPU Rendering", 2020): a bijection of `u32`, cheap, and good enough for stochastic rounding
/// and dropout. Keys are chained through it (`pcg_hash(b ^ pcg_hash(a))`).
pub fn pcg_hash(input: u32) -> u32 {
    let state = input
        .wrapping_mul(PCG_MULTIPLIER)
        .wrapping_add(PCG_INCREMENT);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(PCG_OUTPUT_MULTIPLIER);
    (word >> 22) ^ word
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The hash on a device.

    use cubecl::prelude::*;

    use super::{PCG_INCREMENT, PCG_MULTIPLIER, PCG_OUTPUT_MULTIPLIER};

    /// [`super::pcg_hash`]; `u32` arithmetic wraps on a device.
    #[cube]
    pub fn pcg_hash(input: u32) -> u32 {
        let state = input * PCG_MULTIPLIER + PCG_INCREMENT;
        let word = ((state >> ((state >> 28) + 4)) ^ state) * PCG_OUTPUT_MULTIPLIER;
        (word >> 22) ^ word
    }
}
