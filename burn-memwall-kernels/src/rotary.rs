//! Rotary position embedding over rows of `[rows, width]` (contiguous), one unit per adjacent
//! pair of columns: the pair `(a, b)` of the row at position `p`, in the head column `j` of
//! its first element (`width` holds heads of `d_head` side by side), turns by the angle whose
//! `(cos, sin)` the table holds at `[p, j]`: `(a·cos − b·sin, a·sin + b·cos)`, or back by it
//! with `inverse` (the backward pass: a rotation's transpose is its inverse). Arithmetic is f32
//! whatever `F` is.

use cubecl::prelude::*;

/// `out` = `x` rotated (`x`, `out` `[rows, width]`; `table` `[seq, d_head, 2]`, row `r` at
/// position `r % seq`).
#[cube(launch)]
pub fn rotary_kernel<F: Float>(
    x: &Tensor<F>,
    table: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] inverse: bool,
    #[define(F)] _dtype: ElemType,
) {
    let pair = ABSOLUTE_POS;
    if pair * 2 >= out.len() {
        terminate!();
    }
    let width = x.shape(1);
    let (seq, d_head) = (table.shape(0), table.shape(1));
    let i = pair * 2;
    let (row, column) = (i / width, i % width);
    let angle = ((row % seq) * d_head + column % d_head) * 2;
    let (cos, sin) = (table[angle], table[angle + 1]);
    let a = f32::cast_from(x[i]);
    let b = f32::cast_from(x[i + 1]);
    if comptime!(inverse) {
        out[i] = F::cast_from(a * cos + b * sin);
        out[i + 1] = F::cast_from(b * cos - a * sin);
    } else {
        out[i] = F::cast_from(a * cos - b * sin);
        out[i + 1] = F::cast_from(a * sin + b * cos);
    }
}
