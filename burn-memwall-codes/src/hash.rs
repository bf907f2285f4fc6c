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

/// A uniform number of `element` under a draw's [`draw_key`]: a number in `[0, 1)` from a
/// counter-based hash of `(seed, step, element)`, so the same key gives the same number on
/// every device and every data-parallel replica, with no state. Stochastic rounding draws
/// its numbers here.
pub fn keyed_uniform(key: u32, element: u32) -> f32 {
    (pcg_hash(element ^ key) >> (32 - UNIFORM_BITS)) as f32 * UNIFORM_UNIT
}

/// The bits of the hash that make a uniform number: all that an f32 holds exactly.
pub const UNIFORM_BITS: u32 = 24;
/// The uniform number's resolution, `2^−UNIFORM_BITS`.
pub const UNIFORM_UNIT: f32 = 1.0 / (1u32 << UNIFORM_BITS) as f32;

/// The part of [`keyed_uniform`]'s hash that one draw (`seed`, `step`) shares across its
/// elements.
pub fn draw_key(seed: u32, step: u32) -> u32 {
    pcg_hash(step ^ pcg_hash(seed))
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The hash on a device.

    use cubecl::prelude::*;

    use super::{PCG_INCREMENT, PCG_MULTIPLIER, PCG_OUTPUT_MULTIPLIER, UNIFORM_BITS, UNIFORM_UNIT};

    /// [`super::pcg_hash`]; `u32` arithmetic wraps on a device.
    #[cube]
    pub fn pcg_hash(input: u32) -> u32 {
        let state = input * PCG_MULTIPLIER + PCG_INCREMENT;
        let word = ((state >> ((state >> 28) + 4)) ^ state) * PCG_OUTPUT_MULTIPLIER;
        (word >> 22) ^ word
    }

    /// [`super::keyed_uniform`].
    #[cube]
    pub fn keyed_uniform(key: u32, element: u32) -> f32 {
        f32::cast_from(pcg_hash(element ^ key) >> (32 - UNIFORM_BITS)) * UNIFORM_UNIT
    }
}
