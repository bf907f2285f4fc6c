//! Products with a packed ternary weight `W = diag(s) · T` (`[d_output, d_input]`), decoded
//! inside the GEMM: each cube decodes the codes of its tile into shared memory and multiplies
//! from there, so no dense weight exists outside one `TILE × STEP` (`128 × 16`) tile per cube.
//! Each unit keeps `8 × 8` outputs in registers.
//!
//! Two packings, both 16 weights per group (`comptime` `counter`):
//! - ternary: `t + 1` in 2 bits, 16 per `u32` word;
//! - counter synapse: 6-bit codes, 16 per 3 words, `t = code / (2C − 1) − 1` (see
//!   [`crate::counter`]).
//!
//! One kernel serves both products (`comptime` `transposed`); they differ only in which code
//! fills which place of the weight tile:
//! - `x · Wᵀ`: `[m, d_input]` → `[m, d_output]`, the reduction runs along a weight row;
//! - `dy · W`: `[m, d_output]` → `[m, d_input]`, the reduction runs down the weight rows.

use cubecl::prelude::*;

use crate::counter::code_at;

/// Units per side of a cube.
pub const UNITS_PER_SIDE: usize = 16;
/// Outputs per unit along each side.
const PER_UNIT: usize = 8;
/// Outputs per cube along each side of its tile.
pub const TILE: usize = UNITS_PER_SIDE * PER_UNIT;
/// The reduction's step: one group of 16 weights.
const STEP: usize = 16;
/// Elements of a `TILE × STEP` tile each unit loads.
const LOADS: usize = TILE * STEP / (UNITS_PER_SIDE * UNITS_PER_SIDE);

/// `s[row] · t(row, i)`: weight `i` of weight row `row`.
#[cube]
fn weight_at(
    codes: &Tensor<u32>,
    scale: &Tensor<f32>,
    row: u32,
    i: u32,
    words_per_row: u32,
    counter_states: u32,
    #[comptime] counter: bool,
) -> f32 {
    let base = usize::cast_from(row * words_per_row);
    let shifted = if counter {
        code_at(codes, base, i) / counter_states
    } else {
        (codes[base + usize::cast_from(i / 16)] >> ((i % 16) * 2)) & 3
    };
    scale[usize::cast_from(row)] * (f32::cast_from(shifted) - 1.0f32)
}

/// `output = input · Wᵀ` (`transposed = false`) or `input · W` (`transposed = true`), f32 and
/// contiguous. `cube_dim = (UNITS_PER_SIDE, UNITS_PER_SIDE, 1)`,
/// `cube_count = (⌈columns / TILE⌉, ⌈m / TILE⌉, 1)`.
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
    counter_states: u32,
    #[comptime] counter: bool,
    #[comptime] transposed: bool,
) {
    let m = u32::cast_from(input.shape(0));
    let reduction = u32::cast_from(input.shape(1));
    let columns = u32::cast_from(output.shape(1));
    let tile = TILE as u32;
    let step = STEP as u32;
    let first_row = CUBE_POS_Y * tile;
    let first_column = CUBE_POS_X * tile;
    let unit = UNIT_POS_Y * UNITS_PER_SIDE as u32 + UNIT_POS_X;
    let units = (UNITS_PER_SIDE * UNITS_PER_SIDE) as u32;

    // Both tiles are stored reduction-major, `[STEP][TILE]`, so the inner loop reads a row of
    // each.
    let mut inputs = Shared::<[f32]>::new_slice(TILE * STEP);
    let mut weights = Shared::<[f32]>::new_slice(TILE * STEP);
    let mut sums = Array::<f32>::new(PER_UNIT * PER_UNIT);
    #[unroll]
    for i in 0..PER_UNIT * PER_UNIT {
        sums[i] = 0.0f32;
    }

    let mut start = 0u32;
    while start < reduction {
        #[unroll]
        for load in 0..LOADS {
            let element = unit + u32::cast_from(load) * units;
            // The input tile: 16 consecutive units read one row's step.
            let k = element % step;
            let r = element / step;
            let row = first_row + r;
            let mut value = 0.0f32;
            if row < m && start + k < reduction {
                value = input[usize::cast_from(row) * usize::cast_from(reduction)
                    + usize::cast_from(start + k)];
            }
            inputs[usize::cast_from(k * tile + r)] = value;

            // The weight tile: consecutive units decode consecutive weights of one weight row.
            let mut k_w = k;
            let mut c = r;
            if transposed {
                k_w = element / tile;
                c = element % tile;
            }
            let column = first_column + c;
            let mut weight_row = column;
            let mut weight_input = start + k_w;
            if transposed {
                weight_row = start + k_w;
                weight_input = column;
            }
            let mut weight = 0.0f32;
            if weight_row < d_output && weight_input < d_input {
                weight = weight_at(
                    codes,
                    scale,
                    weight_row,
                    weight_input,
                    words_per_row,
                    counter_states,
                    counter,
                );
            }
            weights[usize::cast_from(k_w * tile + c)] = weight;
        }
        sync_cube();

        #[unroll]
        for k in 0..STEP {
            #[unroll]
            for i in 0..PER_UNIT {
                let a = inputs[k * TILE + UNIT_POS_Y as usize + i * UNITS_PER_SIDE];
                #[unroll]
                for j in 0..PER_UNIT {
                    let b = weights[k * TILE + UNIT_POS_X as usize + j * UNITS_PER_SIDE];
                    sums[i * PER_UNIT + j] += a * b;
                }
            }
        }
        sync_cube();
        start += step;
    }

    #[unroll]
    for i in 0..PER_UNIT {
        let row = first_row + UNIT_POS_Y + u32::cast_from(i * UNITS_PER_SIDE);
        #[unroll]
        for j in 0..PER_UNIT {
            let column = first_column + UNIT_POS_X + u32::cast_from(j * UNITS_PER_SIDE);
            if row < m && column < columns {
                output[usize::cast_from(row) * usize::cast_from(columns)
                    + usize::cast_from(column)] = sums[i * PER_UNIT + j];
            }
        }
    }
}
