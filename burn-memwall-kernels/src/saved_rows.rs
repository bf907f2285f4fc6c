//! Activations kept in 8 or 4 bits (`burn_memwall_codes::saved_rows`): the packing, one unit per
//! word, with the hash's uniform numbers; the restore, one unit per value. The Flex path's
//! results, bit for bit.

use burn_memwall_codes::hash::cube::keyed_uniform;
use burn_memwall_codes::saved_rows::cube::{code_at, field};
use burn_memwall_codes::saved_rows::lanes;
use cubecl::prelude::*;

/// `words[row, w]` packs values `w·lanes..(w + 1)·lanes` of row `row` of `values`
/// (`[rows, width]`, contiguous) in steps of `scales[row]`, value `i` (row-major) drawing
/// `keyed_uniform(key, i)`. Lanes past the row's end stay zero.
#[cube(launch)]
pub fn pack_rows_kernel<F: Float>(
    values: &Tensor<F>,
    scales: &Tensor<f32>,
    words: &mut Tensor<u32>,
    width: u32,
    words_per_row: u32,
    key: u32,
    #[comptime] bits: u32,
    #[define(F)] _dtype: ElemType,
) {
    let w = ABSOLUTE_POS;
    if w >= words.len() {
        terminate!();
    }
    let w = u32::cast_from(w);
    let row = w / words_per_row;
    let first = (w % words_per_row) * comptime!(lanes(bits));
    let scale = scales[usize::cast_from(row)];
    let mut word = 0u32;
    #[unroll]
    for lane in 0..comptime!(lanes(bits)) {
        let column = first + lane;
        if column < width {
            let i = row * width + column;
            let x = f32::cast_from(values[usize::cast_from(i)]);
            word |= field(x, scale, keyed_uniform(key, i), bits) << (lane * bits);
        }
    }
    words[usize::cast_from(w)] = word;
}

/// `out[row, column] = code · scales[row]` of the packed rows (`out` `[rows, width]`,
/// contiguous).
#[cube(launch)]
pub fn restore_rows_kernel<F: Float>(
    words: &Tensor<u32>,
    scales: &Tensor<f32>,
    out: &mut Tensor<F>,
    width: u32,
    words_per_row: u32,
    #[comptime] bits: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let index = u32::cast_from(i);
    let (row, column) = (index / width, index % width);
    let lanes = comptime!(lanes(bits));
    let word = words[usize::cast_from(row * words_per_row + column / lanes)];
    let code = code_at(word, column % lanes, bits);
    out[i] = F::cast_from(f32::cast_from(code) * scales[usize::cast_from(row)]);
}
