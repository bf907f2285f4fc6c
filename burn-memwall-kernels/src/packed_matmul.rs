//! Products with a packed ternary weight `W = diag(s) · T` (`[d_output, d_input]`), decoded
//! inside the GEMM: each cube decodes the codes of its tile into shared memory and multiplies
//! from there, so no dense weight exists outside one `128 × 16` tile per cube.
//!
//! Two packings, both 16 weights per group (`comptime` `counter`):
//! - ternary: `t + 1` in 2 bits, 16 per `u32` word;
//! - counter synapse: 6-bit codes, 16 per 3 words, `t = code / (2C − 1) − 1`.
//!
//! Both are read through their homes' `#[cube]` helpers (`burn_memwall_codes::{counter,
//! ternary}::cube`).
//!
//! One kernel serves both products (`comptime` `transposed`); they differ only in which code
//! fills which place of the weight tile:
//! - `x · Wᵀ`: `[m, d_input]` → `[m, d_output]`, the reduction runs along a weight row;
//! - `dy · W`: `[m, d_output]` → `[m, d_input]`, the reduction runs down the weight rows.
//!
//! [`packed_decode_kernel()`] writes the weight itself, one unit per weight: for a few rows
//! gathered from a larger one (an embedding lookup).

use cubecl::prelude::*;

use burn_memwall_codes::counter::cube::{code_at, counter_states, ternary_plus_one};
use burn_memwall_codes::ternary::cube::ternary_plus_one_at;

/// Units per side of a cube.
pub const UNITS_PER_SIDE: usize = 16;
/// Outputs per unit along a row of the output.
const COLUMNS_PER_UNIT: usize = 8;
/// Output columns per cube.
pub const TILE_COLUMNS: usize = UNITS_PER_SIDE * COLUMNS_PER_UNIT;
/// The reduction's step: the depth of a tile, in weights.
const STEP: usize = 16;
const UNITS: usize = UNITS_PER_SIDE * UNITS_PER_SIDE;

/// `s[row] · t(row, i)`: weight `i` of weight row `row`.
#[cube]
fn weight_at(
    codes: &Tensor<u32>,
    scale: &Tensor<f32>,
    row: u32,
    i: u32,
    words_per_row: u32,
    counter_limit: u32,
    #[comptime] counter: bool,
) -> f32 {
    let base = usize::cast_from(row * words_per_row);
    let shifted = if counter {
        ternary_plus_one(code_at(codes, base, i), counter_states(counter_limit))
    } else {
        ternary_plus_one_at(codes, base, i)
    };
    scale[usize::cast_from(row)] * (f32::cast_from(shifted) - 1.0f32)
}

/// `output = W` (`[d_output, d_input]`, contiguous), one unit per weight.
#[cube(launch)]
pub fn packed_decode_kernel(
    codes: &Tensor<u32>,
    scale: &Tensor<f32>,
    output: &mut Tensor<f32>,
    d_input: u32,
    words_per_row: u32,
    counter_limit: u32,
    #[comptime] counter: bool,
) {
    let index = ABSOLUTE_POS;
    if index >= output.len() {
        terminate!();
    }
    let width = usize::cast_from(d_input);
    output[index] = weight_at(
        codes,
        scale,
        u32::cast_from(index / width),
        u32::cast_from(index % width),
        words_per_row,
        counter_limit,
        counter,
    );
}

/// `output = input · Wᵀ` (`transposed = false`) or `input · W` (`transposed = true`), f32 and
/// contiguous. Each unit keeps `rows_per_unit × 8` outputs in registers (`rows_per_unit` ≤ 8:
/// fewer for few rows, so that a small batch does not fill a tile of empty rows).
/// `cube_dim = (UNITS_PER_SIDE, UNITS_PER_SIDE, 1)`,
/// `cube_count = (⌈columns / TILE_COLUMNS⌉, ⌈m / (UNITS_PER_SIDE · rows_per_unit)⌉, 1)`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn packed_matmul_kernel(
    input: &Tensor<f32>,
    codes: &Tensor<u32>,
    scale: &Tensor<f32>,
    output: &mut Tensor<f32>,
    d_input: u32,
    d_output: u32,
    words_per_row: u32,
    counter_limit: u32,
    #[comptime] rows_per_unit: usize,
    #[comptime] counter: bool,
    #[comptime] transposed: bool,
) {
    let m = u32::cast_from(input.shape(0));
    let reduction = u32::cast_from(input.shape(1));
    let columns = u32::cast_from(output.shape(1));
    let tile_rows = comptime!(UNITS_PER_SIDE * rows_per_unit);
    let step = STEP as u32;
    let first_row = CUBE_POS_Y * tile_rows as u32;
    let first_column = CUBE_POS_X * TILE_COLUMNS as u32;
    let unit = UNIT_POS_Y * UNITS_PER_SIDE as u32 + UNIT_POS_X;

    // Both tiles are stored reduction-major, `[STEP][rows or columns]`, so the inner loop reads
    // a row of each. The weight tile holds runs of 4 columns: unit `x` owns the runs `x` and
    // `x + 16` (columns `4x ..` and `64 + 4x ..`), so 16 neighbouring units read 16
    // consecutive runs.
    let mut inputs = Shared::<[f32]>::new_slice(comptime!(tile_rows * STEP));
    let mut weights = Shared::<[Vector<f32, Const<4>>]>::new_slice(TILE_COLUMNS / 4 * STEP);
    let mut sums = Array::<Vector<f32, Const<4>>>::new(comptime!(rows_per_unit * 2));
    #[unroll]
    for i in 0..rows_per_unit * 2 {
        sums[i] = Vector::new(0.0f32);
    }
    let runs = (TILE_COLUMNS / 4) as u32;

    let mut start = 0u32;
    while start < reduction {
        // The input tile: 16 consecutive units read one row's step.
        #[unroll]
        for load in 0..comptime!(tile_rows * STEP / UNITS) {
            let element = unit + u32::cast_from(load * UNITS);
            let k = element % step;
            let r = element / step;
            let row = first_row + r;
            let mut value = 0.0f32;
            if row < m && start + k < reduction {
                value = input[usize::cast_from(row) * usize::cast_from(reduction)
                    + usize::cast_from(start + k)];
            }
            inputs[usize::cast_from(k * tile_rows as u32 + r)] = value;
        }
        // The weight tile, a run of 4 columns per load: consecutive units decode consecutive
        // weights of one weight row.
        #[unroll]
        for load in 0..TILE_COLUMNS / 4 * STEP / UNITS {
            let slot = unit + u32::cast_from(load * UNITS);
            let mut k = slot % step;
            let mut run = slot / step;
            if transposed {
                k = slot / runs;
                run = slot % runs;
            }
            let mut values = Vector::<f32, Const<4>>::new(0.0f32);
            #[unroll]
            for q in 0..4usize {
                let column = first_column + run * 4 + u32::cast_from(q);
                let mut weight_row = column;
                let mut weight_input = start + k;
                if transposed {
                    weight_row = start + k;
                    weight_input = column;
                }
                if weight_row < d_output && weight_input < d_input {
                    values.insert(
                        q,
                        weight_at(
                            codes,
                            scale,
                            weight_row,
                            weight_input,
                            words_per_row,
                            counter_limit,
                            counter,
                        ),
                    );
                }
            }
            weights[usize::cast_from(k * runs + run)] = values;
        }
        sync_cube();

        #[unroll]
        for k in 0..STEP {
            let low = weights[k * TILE_COLUMNS / 4 + UNIT_POS_X as usize];
            let high = weights[k * TILE_COLUMNS / 4 + UNIT_POS_X as usize + UNITS_PER_SIDE];
            #[unroll]
            for i in 0..rows_per_unit {
                let a = Vector::<f32, Const<4>>::new(
                    inputs[k * tile_rows + UNIT_POS_Y as usize + i * UNITS_PER_SIDE],
                );
                sums[i * 2] += a * low;
                sums[i * 2 + 1] += a * high;
            }
        }
        sync_cube();
        start += step;
    }

    #[unroll]
    for i in 0..rows_per_unit {
        let row = first_row + UNIT_POS_Y + u32::cast_from(i * UNITS_PER_SIDE);
        #[unroll]
        for half in 0..2usize {
            let sum = sums[i * 2 + half];
            #[unroll]
            for q in 0..4usize {
                let column =
                    first_column + u32::cast_from(half * TILE_COLUMNS / 2 + q) + UNIT_POS_X * 4;
                if row < m && column < columns {
                    output[usize::cast_from(row) * usize::cast_from(columns)
                        + usize::cast_from(column)] = sum.extract(q);
                }
            }
        }
    }
}
