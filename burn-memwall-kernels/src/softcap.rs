//! Logit soft-capping `c · tanh(x / c)` (Gemma 2), shared by the attention scores and the
//! LM-head logits.

use cubecl::prelude::*;

/// `cap · tanh(x / cap)` when `capped`, else `x`.
#[cube]
pub(crate) fn soft_cap(x: f32, cap: f32, #[comptime] capped: bool) -> f32 {
    let mut y = x;
    if capped {
        y = cap * (x / cap).tanh();
    }
    y
}

/// `∂y/∂x` written with the capped value `y`: `1 − (y / cap)²` when `capped`, else 1.
#[cube]
pub(crate) fn soft_cap_slope(y: f32, cap: f32, #[comptime] capped: bool) -> f32 {
    let mut slope = 1.0f32;
    if capped {
        let t = y / cap;
        slope = 1.0f32 - t * t;
    }
    slope
}
