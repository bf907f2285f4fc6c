//! RMSNorm over the rows of `[rows, d]` (contiguous): `y = x / rms · γ` with
//! `rms = √(mean(x²) + ε)` kept per row in f32; and its backward from the output alone. With
//! `x̂ = x / rms = y / γ` and `g = dy · γ`, `g · x̂ = dy · y`, so
//! `dx = (dy · γ − (y / γ) · mean(dy · y)) / rms`, and the scale's gradient is
//! `Σ_rows dy · y` divided by `γ`: the sums over row chunks here, their sum by the caller.
//!
//! Launch of the row kernels: a cube per row, `units` (a power of two) per cube striding over
//! the row, a tree over the cube's units for the row's sum. Arithmetic is f32 whatever `F` is.

use cubecl::prelude::*;

use crate::reduce::cube_sum;

/// `Σ_j a[at + j] · b[at + j]` over the row of `d` elements from `at`, in every unit of the cube.
#[cube]
fn row_dot<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    at: usize,
    d: usize,
    #[comptime] units: usize,
) -> f32 {
    let mut part = 0.0f32;
    let mut j = UNIT_POS_X as usize;
    while j < d {
        part += f32::cast_from(a[at + j]) * f32::cast_from(b[at + j]);
        j += units;
    }
    cube_sum(part, units)
}

/// `y` and `rms` of each row of `x`.
#[cube(launch)]
pub fn rms_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    y: &mut Tensor<F>,
    rms: &mut Tensor<f32>,
    epsilon: f32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let d = x.shape(1);
    let at = row * d;
    let squares = row_dot(x, x, at, d, units);
    let row_rms = (squares / f32::cast_from(u32::cast_from(d)) + epsilon).sqrt();
    if UNIT_POS_X == 0 {
        rms[row] = row_rms;
    }
    let mut j = UNIT_POS_X as usize;
    while j < d {
        y[at + j] = F::cast_from(f32::cast_from(x[at + j]) / row_rms * f32::cast_from(gamma[j]));
        j += units;
    }
}

/// `dx` of each row from the output `y`, its gradient `dy`, `γ` and the row's `rms`.
#[cube(launch)]
pub fn rms_norm_backward_kernel<F: Float>(
    dy: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    rms: &Tensor<f32>,
    dx: &mut Tensor<F>,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let d = y.shape(1);
    let at = row * d;
    let projection = row_dot(dy, y, at, d, units) / f32::cast_from(u32::cast_from(d));
    let row_rms = rms[row];
    let mut j = UNIT_POS_X as usize;
    while j < d {
        let scale = f32::cast_from(gamma[j]);
        let x_hat = f32::cast_from(y[at + j]) / scale;
        let g = f32::cast_from(dy[at + j]) * scale;
        dx[at + j] = F::cast_from((g - x_hat * projection) / row_rms);
        j += units;
    }
}

/// `partial[c, j] = Σ dy[r, j] · y[r, j]` over the rows `r` of chunk `c`
/// (`c·rows_per_chunk..`): one unit per element of `partial` (`[chunks, d]`), the units of a
/// row chunk reading its rows' columns side by side.
#[cube(launch)]
pub fn rms_norm_scale_gradient_kernel<F: Float>(
    dy: &Tensor<F>,
    y: &Tensor<F>,
    partial: &mut Tensor<f32>,
    rows_per_chunk: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= partial.len() {
        terminate!();
    }
    let d = y.shape(1);
    let (chunk, column) = (i / d, i % d);
    let first = chunk * usize::cast_from(rows_per_chunk);
    let end = min(first + usize::cast_from(rows_per_chunk), y.shape(0));
    let mut sum = 0.0f32;
    let mut r = first;
    while r < end {
        let at = r * d + column;
        sum += f32::cast_from(dy[at]) * f32::cast_from(y[at]);
        r += 1;
    }
    partial[i] = sum;
}
