//! The counter synapse's update kernel, mirroring `burn_memwall_codes::counter::update_row`
//! operation for operation so that both give the same codes from the same gradient and seed.
//! The code's format (its bits, its packing, `(t, c)`) and the rounding's hash are read through
//! [`burn_memwall_codes::counter::cube`], the same home as the host's.
//!
//! [`counter_update_kernel()`] runs the whole update of a block of rows in one pass, one cube of
//! `lanes` units per row: the row's statistics (partial sums per unit, then a tree, in the
//! order of the reference), then each unit ticks its own groups of codes in place. The
//! products with the weight are [`crate::packed_matmul`]'s.

use burn_memwall_codes::counter::cube::{
    code_at, counter, counter_states, encode, set_code, ternary_plus_one,
};
use burn_memwall_codes::counter::{CODES_PER_GROUP, SCALE_MAX, SCALE_MIN, TARGET_BOUND};
use burn_memwall_codes::hash::cube::keyed_uniform;
use cubecl::prelude::*;

/// One update of the rows `row_start ..` of a block from their gradient `[rows, d_input]`:
/// `v ← βv + (1−β)·mean g²`, `D = max(√(v / bias_correction), ε)`,
/// `s' = clip(s − η_s Σ g·t / √d_input, SCALE_MIN, SCALE_MAX)`, then per weight the tick
/// `Δ = −η (g/D)(C/s')` on the counter rebased to `s'`, stochastic rounding with
/// `u = hash(element ^ key)` (`key` = the hash of the seed and step, from the host), and the
/// carry into `t`, pinned at the wall. `cube_count = (rows, 1, 1)`, `cube_dim = (lanes, 1, 1)`
/// with `lanes` a power of two (`counter::STATISTIC_LANES`, for the reference's order).
// `div_ceil` and `RangeInclusive::contains` have no cube expansion.
#[allow(
    clippy::too_many_arguments,
    clippy::manual_div_ceil,
    clippy::manual_range_contains
)]
#[cube(launch)]
pub fn counter_update_kernel(
    codes: &mut Tensor<u32>,
    scale: &mut Tensor<f32>,
    mean_square: &mut Tensor<f32>,
    gradient: &Tensor<f32>,
    row_start: u32,
    d_input: u32,
    words_per_row: u32,
    limit: u32,
    learning_rate: f32,
    scale_learning_rate: f32,
    beta: f32,
    bias_correction: f32,
    epsilon: f32,
    key: u32,
    #[comptime] lanes: usize,
) {
    let block_row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X;
    let row = usize::cast_from(row_start) + block_row;
    let base = row * usize::cast_from(words_per_row);
    let gradient_base = block_row * usize::cast_from(d_input);
    let states = counter_states(limit);
    let limit_f = f32::cast_from(limit);
    let wall = limit - 1;

    // Each unit sums elements `unit, unit + units, …`; then a tree over the units (halving),
    // in the order of the reference's `row_step`.
    let units = CUBE_DIM_X;
    let mut squares = Shared::<[f32]>::new_slice(lanes);
    let mut aligns = Shared::<[f32]>::new_slice(lanes);
    let mut square_sum = 0.0f32;
    let mut aligned = 0.0f32;
    let mut i = unit;
    while i < d_input {
        let g = gradient[gradient_base + usize::cast_from(i)];
        square_sum += g * g;
        let ternary = f32::cast_from(ternary_plus_one(code_at(&*codes, base, i), states)) - 1.0f32;
        aligned += g * ternary;
        i += units;
    }
    squares[unit as usize] = square_sum;
    aligns[unit as usize] = aligned;
    sync_cube();
    let mut half = units / 2;
    while half > 0 {
        if unit < half {
            let a = squares[unit as usize] + squares[(unit + half) as usize];
            let b = aligns[unit as usize] + aligns[(unit + half) as usize];
            squares[unit as usize] = a;
            aligns[unit as usize] = b;
        }
        sync_cube();
        half /= 2;
    }

    // [D, s, s']
    let mut stats = Shared::<[f32]>::new_slice(3usize);
    if unit == 0 {
        let n_in = f32::cast_from(d_input);
        let v = beta * mean_square[row] + (1.0f32 - beta) * squares[0] / n_in;
        mean_square[row] = v;
        let old = scale[row];
        let new = clamp(
            old - scale_learning_rate * aligns[0] / n_in.sqrt(),
            SCALE_MIN,
            SCALE_MAX,
        );
        scale[row] = new;
        stats[0] = max((v / bias_correction).sqrt(), epsilon);
        stats[1] = old;
        stats[2] = new;
    }
    sync_cube();
    let step_factor = -learning_rate / stats[0] * (limit_f / stats[2]);
    let rebase = stats[1] / stats[2];
    let limit_i = i32::cast_from(limit);

    // Each unit owns whole groups of codes, which fill whole words, so no two units write one
    // word.
    let per_group = CODES_PER_GROUP as u32;
    let groups = (d_input + per_group - 1) / per_group;
    let mut group = unit;
    while group < groups {
        for k in 0..per_group {
            let i = group * per_group + k;
            if i < d_input {
                let code = code_at(&*codes, base, i);
                let t = i32::cast_from(ternary_plus_one(code, states)) - 1;
                let c = counter(code, limit);
                let g = gradient[gradient_base + usize::cast_from(i)];
                let target = clamp(
                    f32::cast_from(c) * rebase + g * step_factor,
                    -TARGET_BOUND,
                    TARGET_BOUND,
                );
                let whole = i32::cast_from(target);
                let mut floor = whole;
                if target < f32::cast_from(whole) {
                    floor -= i32::new(1);
                }
                let element = u32::cast_from(row) * d_input + i;
                let u = keyed_uniform(key, element);
                let mut q = floor;
                if u < target - f32::cast_from(floor) {
                    q += i32::new(1);
                }
                let mut carry = i32::new(0);
                if q >= limit_i {
                    carry += i32::new(1);
                }
                if q >= limit_i * 2i32 {
                    carry += i32::new(1);
                }
                if q >= limit_i * 3i32 {
                    carry += i32::new(1);
                }
                if q + limit_i <= 0i32 {
                    carry -= i32::new(1);
                }
                if q + limit_i * 2i32 <= 0i32 {
                    carry -= i32::new(1);
                }
                if q + limit_i * 3i32 <= 0i32 {
                    carry -= i32::new(1);
                }
                let ternary = t + carry;
                let wall_i = i32::cast_from(wall);
                let mut new_t = ternary;
                let mut new_c = q - carry * i32::cast_from(limit);
                if ternary > 1 || ternary < -1 {
                    new_t = clamp(ternary, -1, 1);
                    new_c = if q < 0 { -wall_i } else { wall_i };
                } else {
                    new_c = clamp(new_c, -wall_i, wall_i);
                }
                set_code(codes, base, i, encode(new_t, new_c, limit));
            }
        }
        group += CUBE_DIM_X;
    }
}
