//! The counter synapse's kernels, mirroring `burn_memwall::ops::counter_code` operation for
//! operation so that both give the same codes from the same gradient and seed.
//!
//! Codes: 6 bits each, 16 per 3 `u32` words, code `i` of a row at bits `6i .. 6i + 6` of the
//! row's words (little end first); `(t, c) ↔ (t+1)(2C−1) + (c+C−1)`.
//!
//! [`counter_update_kernel`] runs the whole update of a block of rows in one pass, one cube of
//! `lanes` units per row: the row's statistics (partial sums per unit, then a tree, in the
//! order of the reference), then each unit ticks its own groups of 16 codes in place. The
//! products with the weight are [`crate::packed_matmul`]'s.

use cubecl::prelude::*;

/// `counter_code::TARGET_BOUND`: counter units beyond which a weight saturates anyway.
const TARGET_BOUND: f32 = 1048576.0;

/// Code `i` of the row whose words start at `base`.
#[cube]
pub(crate) fn code_at(codes: &Tensor<u32>, base: usize, i: u32) -> u32 {
    let bit = i * 6;
    let word = base + usize::cast_from(bit / 32);
    let shift = bit % 32;
    let mut bits = codes[word] >> shift;
    if shift > 26 {
        bits |= codes[word + 1] << (32 - shift);
    }
    bits & 63
}

/// Writes `code` as code `i` of the row whose words start at `base`.
#[cube]
fn set_code(codes: &mut Tensor<u32>, base: usize, i: u32, code: u32) {
    let bit = i * 6;
    let word = base + usize::cast_from(bit / 32);
    let shift = bit % 32;
    codes[word] = (codes[word] & !(63u32 << shift)) | (code << shift);
    if shift > 26 {
        let high = 32 - shift;
        codes[word + 1] = (codes[word + 1] & !(63u32 >> high)) | (code >> high);
    }
}

/// The PCG-RXS-M-XS hash of one LCG step.
#[cube]
fn pcg_hash(input: u32) -> u32 {
    let state = input * 747_796_405u32 + 2_891_336_453u32;
    let word = ((state >> ((state >> 28) + 4)) ^ state) * 277_803_737u32;
    (word >> 22) ^ word
}

/// One update of the rows `row_start ..` of a block from their gradient `[rows, d_input]`:
/// `v ← βv + (1−β)·mean g²`, `D = max(√(v / bias_correction), ε)`,
/// `s' = clip(s − η_s Σ g·t / √d_input, 1e-5, 10)`, then per weight the tick
/// `Δ = −η (g/D)(C/s')` on the counter rebased to `s'`, stochastic rounding with
/// `u = hash(element ^ key)` (`key` = the hash of the seed and step, from the host), and the
/// carry into `t`, pinned at the wall. `cube_count = (rows, 1, 1)`, `cube_dim = (lanes, 1, 1)`
/// with `lanes` a power of two (`counter_code::STATISTIC_LANES`, for the reference's order).
#[allow(clippy::too_many_arguments)]
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
    let states = 2 * limit - 1;
    let limit_f = f32::cast_from(limit);
    let wall = limit - 1;

    // Each unit sums elements `unit, unit + units, …`; then a tree over the units (halving),
    // in the order of `counter_code::row_step`.
    let units = CUBE_DIM_X;
    let mut squares = Shared::<[f32]>::new_slice(lanes);
    let mut aligns = Shared::<[f32]>::new_slice(lanes);
    let mut square_sum = 0.0f32;
    let mut aligned = 0.0f32;
    let mut i = unit;
    while i < d_input {
        let g = gradient[gradient_base + usize::cast_from(i)];
        square_sum += g * g;
        let ternary = f32::cast_from(code_at(&*codes, base, i) / states) - 1.0f32;
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
            1e-5f32,
            10.0f32,
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

    // Each unit owns whole groups of 16 codes (3 words), so no two units write one word.
    let groups = (d_input + 15) / 16;
    let mut group = unit;
    while group < groups {
        for k in 0..16u32 {
            let i = group * 16 + k;
            if i < d_input {
                let code = code_at(&*codes, base, i);
                let t = i32::cast_from(code / states) - 1;
                let c = i32::cast_from(code % states) - i32::cast_from(wall);
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
                let u = f32::cast_from(pcg_hash(element ^ key) >> 8) * (1.0f32 / 16777216.0f32);
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
                let new_code =
                    u32::cast_from((new_t + 1) * i32::cast_from(states) + new_c + wall_i);
                set_code(codes, base, i, new_code);
            }
        }
        group += CUBE_DIM_X;
    }
}
