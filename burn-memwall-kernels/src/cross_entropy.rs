//! Cross-entropy over rows of logits, the part of the fused LM-head loss that is not a matmul:
//! each cube owns one row of `[rows, vocab]` logits and its units stride over the vocabulary.
//!
//! Per row, with `y = softcap(z)`, `lse = log Σ exp(y)`, target `t`, label smoothing `ε` and
//! z-loss coefficient `λ`:
//! `loss = lse − (1 − ε)·y_t − (ε / vocab)·Σ y + λ·lse²`, and
//! `∂loss/∂y_j = softmax(y)_j·(1 + 2λ·lse) − ε / vocab − (1 − ε)·[j = t]`.
//!
//! Launch: `cube_dim = (units, 1, 1)` with `units` a power of two, `cube_count = (rows, 1, 1)`.
//! - [`cross_entropy_rows_forward_kernel()`]: loss and log-sum-exp of every row, in one read of
//!   the row (an online log-sum-exp per unit, then a tree over the cube's units);
//! - [`cross_entropy_rows_backward_kernel()`]: overwrites each logit with its gradient, scaled by
//!   the row's upstream gradient, from the saved log-sum-exp.
//!
//! Layouts: logits read through their strides; targets `[rows]` in f32 (exact below 2²⁴);
//! loss, lse and the upstream gradient `[rows]` in f32. Arithmetic is f32 whatever `F` is.

use cubecl::prelude::*;

use crate::softcap::{soft_cap, soft_cap_slope};

/// Below every real logit, so that a unit's first logit becomes its running maximum (WGSL has
/// no infinite literal).
const NO_LOGIT: f32 = -3.0e38;

/// Loss and log-sum-exp of each row of `logits`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn cross_entropy_rows_forward_kernel<F: Float>(
    logits: &Tensor<F>,
    targets: &Tensor<f32>,
    loss: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    smoothing: f32,
    z_loss: f32,
    softcap: f32,
    #[comptime] units: usize,
    #[comptime] softcapped: bool,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let vocab = logits.shape(1);
    let at = row * logits.stride(0);
    let stride = logits.stride(1);

    // This unit's share of the row: running max, Σ exp(y − max) and Σ y.
    let mut max = f32::new(NO_LOGIT);
    let mut sum = 0.0f32;
    let mut total = 0.0f32;
    let mut j = unit;
    while j < vocab {
        let y = soft_cap(f32::cast_from(logits[at + j * stride]), softcap, softcapped);
        let next = max.max(y);
        sum = sum * (max - next).exp() + (y - next).exp();
        max = next;
        total += y;
        j += units;
    }

    let mut maxes = Shared::<[f32]>::new_slice(units);
    let mut sums = Shared::<[f32]>::new_slice(units);
    let mut totals = Shared::<[f32]>::new_slice(units);
    maxes[unit] = max;
    sums[unit] = sum;
    totals[unit] = total;
    sync_cube();
    // From the runtime cube size: CubeCL 0.11's IR verifier rejects a mutable variable that
    // starts from a comptime value ("expected cube.ptr, found cube.index").
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if unit < half {
            let a = maxes[unit];
            let b = maxes[unit + half];
            let next = a.max(b);
            let merged = sums[unit] * (a - next).exp() + sums[unit + half] * (b - next).exp();
            let total = totals[unit] + totals[unit + half];
            maxes[unit] = next;
            sums[unit] = merged;
            totals[unit] = total;
        }
        sync_cube();
        half /= 2;
    }

    if unit == 0 {
        let row_lse = maxes[0] + sums[0].ln();
        let target = usize::cast_from(u32::cast_from(targets[row * targets.stride(0)]));
        let y_target = soft_cap(
            f32::cast_from(logits[at + target * stride]),
            softcap,
            softcapped,
        );
        loss[row] = row_lse
            - (1.0f32 - smoothing) * y_target
            - smoothing * totals[0] / f32::cast_from(u32::cast_from(vocab))
            + z_loss * row_lse * row_lse;
        lse[row] = row_lse;
    }
}

/// `logits ← ∂loss/∂logits · d_loss[row]`, in place.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn cross_entropy_rows_backward_kernel<F: Float>(
    logits: &mut Tensor<F>,
    targets: &Tensor<f32>,
    lse: &Tensor<f32>,
    d_loss: &Tensor<f32>,
    smoothing: f32,
    z_loss: f32,
    softcap: f32,
    #[comptime] units: usize,
    #[comptime] softcapped: bool,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let vocab = logits.shape(1);
    let at = row * logits.stride(0);
    let stride = logits.stride(1);
    let row_lse = lse[row * lse.stride(0)];
    let upstream = d_loss[row * d_loss.stride(0)];
    let target = usize::cast_from(u32::cast_from(targets[row * targets.stride(0)]));
    let probability_scale = upstream * (1.0f32 + 2.0f32 * z_loss * row_lse);
    let uniform = upstream * smoothing / f32::cast_from(u32::cast_from(vocab));
    let on_target = upstream * (1.0f32 - smoothing);

    let mut j = UNIT_POS_X as usize;
    while j < vocab {
        let y = soft_cap(f32::cast_from(logits[at + j * stride]), softcap, softcapped);
        let mut dy = (y - row_lse).exp() * probability_scale - uniform;
        if j == target {
            dy -= on_target;
        }
        logits[at + j * stride] = F::cast_from(dy * soft_cap_slope(y, softcap, softcapped));
        j += units;
    }
}
