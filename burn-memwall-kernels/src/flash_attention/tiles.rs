//! How the units of a cube share a block of rows, and the two block products every flash
//! kernel is made of.
//!
//! A cube of `row_units × col_units` units owns a block of `block_rows` rows and, at each step,
//! a block of `block_cols` rows of the other side (keys for a query block, queries for a key
//! block). Unit `u` sits at `(u / col_units, u % col_units)`: it owns rows
//! `u / col_units + row_units · i` (`i < rows_per_unit`), the step's columns
//! `u % col_units + col_units · j` (`j < cols_per_unit`), and of an output row `width` wide the
//! columns `u % col_units + col_units · c` (`c < ⌈width / col_units⌉`), so that neighbouring
//! units read and write neighbouring elements.
//! - [`add_row_products`]: `acc[i, j] += a_row(i) · b_row(j)`, the score tile of `QKᵀ` (or
//!   `dO Vᵀ`, `K Qᵀ`, `V dOᵀ`), both operands staged `chunk` columns at a time;
//! - [`add_weighted_rows`]: `acc[i, c] += Σ_j weights[i, j] · x_row(j)[c]`, the output tile of
//!   `P V` (or `dS K`, `Pᵀ dO`, `dSᵀ Q`), the weights from shared memory and `x` staged
//!   `staged_rows` rows at a time;
//! - [`reduce_rows`]: a row's maximum or sum over the `col_units` units that share it.
//!
//! Shared memory: every phase starts with a barrier before it writes a buffer and ends with
//! the barrier that makes its writes visible, so that a kernel may write the `weights` or the
//! `reduce` buffer at any point after the previous phase's first barrier.

use cubecl::prelude::*;

/// The shape of a cube's work, chosen on the host ([`super::plan`]) and fixed at compile time.
#[derive(Copy, Clone, Debug, Hash, PartialEq, Eq)]
pub struct Tiling {
    /// Units along the block's rows.
    pub row_units: usize,
    /// Units along the step's columns (and the output's).
    pub col_units: usize,
    /// Rows of the block each unit owns.
    pub rows_per_unit: usize,
    /// Columns of each step's score tile each unit owns.
    pub cols_per_unit: usize,
    /// Columns of the inner dimension staged at a time by [`add_row_products`].
    pub chunk: usize,
    /// Rows of `x` staged at a time by [`add_weighted_rows`]; divides `block_cols`.
    pub staged_rows: usize,
}

impl Tiling {
    /// Units per cube.
    pub const fn units(&self) -> usize {
        self.row_units * self.col_units
    }

    /// Rows a cube owns.
    pub const fn block_rows(&self) -> usize {
        self.row_units * self.rows_per_unit
    }

    /// Rows of the other side a cube walks at each step.
    pub const fn block_cols(&self) -> usize {
        self.col_units * self.cols_per_unit
    }

    /// Columns each unit owns of an output row `width` wide.
    pub const fn cols_of(&self, width: usize) -> usize {
        width.div_ceil(self.col_units)
    }

    /// `width` rounded up to whole columns of every unit.
    pub const fn padded(&self, width: usize) -> usize {
        self.cols_of(width) * self.col_units
    }

    /// f32 slots of the staging buffer, for rows at most `width` wide.
    pub const fn stage_len(&self, width: usize) -> usize {
        let products = self.chunk * (self.block_rows() + 1 + self.block_cols() + 1);
        let rows = self.staged_rows * self.padded(width);
        if products > rows { products } else { rows }
    }

    /// f32 slots of the weights buffer: a `block_rows × block_cols` tile, rows padded by one
    /// so that a column's reads fall in different banks.
    pub const fn weights_len(&self) -> usize {
        self.block_rows() * (self.block_cols() + 1)
    }

    /// f32 slots of the buffer where the units sharing a row meet.
    pub const fn reduce_len(&self) -> usize {
        self.block_rows() * self.col_units
    }
}

/// A run of rows of a rank-4 tensor: the offset of its (batch, head) pair, the first row, and
/// the sequence's length (rows past it read as zeros).
#[derive(CubeType, Clone, Copy)]
pub struct Rows {
    /// Offset of row 0 of the pair.
    pub base: usize,
    /// The first row of the run.
    pub first: usize,
    /// Rows in the sequence.
    pub len: usize,
}

/// Rows `first ..` of head `head` of batch element `batch` of `t`, `len` rows in all.
#[cube]
pub fn rows_of<F: Float>(
    t: &Tensor<F>,
    batch: usize,
    head: usize,
    first: usize,
    len: usize,
) -> Rows {
    Rows {
        base: batch * t.stride(0) + head * t.stride(1),
        first,
        len,
    }
}

/// This unit's place `(row, column)` in the cube's grid of units.
#[cube]
pub fn unit_place(#[comptime] tiling: Tiling) -> (usize, usize) {
    let unit = UNIT_POS_X as usize;
    (unit / tiling.col_units, unit % tiling.col_units)
}

/// Block row of this unit's `i`-th row.
#[cube]
pub fn block_row(i: usize, #[comptime] tiling: Tiling) -> usize {
    let (row, _) = unit_place(tiling);
    row + i * tiling.row_units
}

/// Block column of this unit's `j`-th column.
#[cube]
pub fn block_col(j: usize, #[comptime] tiling: Tiling) -> usize {
    let (_, col) = unit_place(tiling);
    col + j * tiling.col_units
}

/// Columns `from .. from + chunk` of `block` rows of `t` into `stage[offset ..]`, column-major
/// (`[chunk][block + 1]`): consecutive units load consecutive columns of a row, and the inner
/// loop of [`add_row_products`] reads a column of the block.
#[allow(clippy::too_many_arguments)]
#[cube]
fn stage_columns<F: Float>(
    stage: &mut Shared<[f32]>,
    t: &Tensor<F>,
    rows: &Rows,
    from: usize,
    #[comptime] offset: usize,
    #[comptime] block: usize,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let (chunk, units) = comptime!((tiling.chunk, tiling.units()));
    let elements = comptime!(block * chunk);
    #[unroll]
    for load in 0..comptime!(elements.div_ceil(units)) {
        let element = UNIT_POS_X as usize + load * units;
        if element < elements {
            let (r, c) = (element / chunk, element % chunk);
            let (row, col) = (rows.first + r, from + c);
            let mut value = 0.0f32;
            if row < rows.len && col < width {
                value = f32::cast_from(t[rows.base + row * t.stride(2) + col * t.stride(3)]);
            }
            stage[offset + c * (block + 1) + r] = value;
        }
    }
}

/// `acc[i · cols_per_unit + j] += a_row(i) · b_row(j)` over the `width` columns of both, for
/// this unit's rows `i` of `a_rows` (a block of `block_rows`) and columns `j` of `b_rows` (a
/// block of `block_cols`). Rows past either sequence's end add zero.
#[allow(clippy::too_many_arguments)]
#[cube]
pub fn add_row_products<F: Float>(
    acc: &mut Array<f32>,
    a: &Tensor<F>,
    a_rows: &Rows,
    b: &Tensor<F>,
    b_rows: &Rows,
    stage: &mut Shared<[f32]>,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let (rows, cols) = (tiling.rows_per_unit, tiling.cols_per_unit);
    let (block_rows, block_cols, chunk) =
        comptime!((tiling.block_rows(), tiling.block_cols(), tiling.chunk));
    let b_offset = comptime!(chunk * (block_rows + 1));
    let (unit_row, unit_col) = unit_place(tiling);
    let mut a_values = Array::<f32>::new(rows);
    let mut b_values = Array::<f32>::new(cols);
    for step in 0..comptime!(width.div_ceil(chunk)) {
        let from = step * chunk;
        sync_cube();
        stage_columns(stage, a, a_rows, from, 0usize, block_rows, width, tiling);
        stage_columns(stage, b, b_rows, from, b_offset, block_cols, width, tiling);
        sync_cube();
        #[unroll]
        for c in 0..chunk {
            #[unroll]
            for i in 0..rows {
                a_values[i] = stage[c * (block_rows + 1) + unit_row + i * tiling.row_units];
            }
            #[unroll]
            for j in 0..cols {
                b_values[j] =
                    stage[b_offset + c * (block_cols + 1) + unit_col + j * tiling.col_units];
            }
            #[unroll]
            for i in 0..rows {
                #[unroll]
                for j in 0..cols {
                    acc[i * cols + j] += a_values[i] * b_values[j];
                }
            }
        }
    }
}

/// `acc[i · ⌈width / col_units⌉ + c] += Σ_j weights[i, j] · x_row(j)[c]` for this unit's rows
/// `i` and output columns `c`, over the `block_cols` rows of `x_rows`; `weights` holds the
/// block's `[block_rows][block_cols + 1]` tile, written by every unit before the call.
#[cube]
pub fn add_weighted_rows<F: Float>(
    acc: &mut Array<f32>,
    weights: &Shared<[f32]>,
    x: &Tensor<F>,
    x_rows: &Rows,
    stage: &mut Shared<[f32]>,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let (rows, staged, units) =
        comptime!((tiling.rows_per_unit, tiling.staged_rows, tiling.units()));
    let (outputs, padded) = comptime!((tiling.cols_of(width), tiling.padded(width)));
    let weights_stride = comptime!(tiling.block_cols() + 1);
    let elements = comptime!(staged * padded);
    let (unit_row, unit_col) = unit_place(tiling);
    let mut w = Array::<f32>::new(rows);
    for step in 0..comptime!(tiling.block_cols() / staged) {
        let from = step * staged;
        sync_cube();
        #[unroll]
        for load in 0..comptime!(elements.div_ceil(units)) {
            let element = UNIT_POS_X as usize + load * units;
            if element < elements {
                let (r, c) = (element / padded, element % padded);
                let row = x_rows.first + from + r;
                let mut value = 0.0f32;
                if row < x_rows.len && c < width {
                    value = f32::cast_from(x[x_rows.base + row * x.stride(2) + c * x.stride(3)]);
                }
                stage[element] = value;
            }
        }
        sync_cube();
        #[unroll]
        for r in 0..staged {
            #[unroll]
            for i in 0..rows {
                w[i] = weights[(unit_row + i * tiling.row_units) * weights_stride + from + r];
            }
            #[unroll]
            for c in 0..outputs {
                let value = stage[r * padded + unit_col + c * tiling.col_units];
                #[unroll]
                for i in 0..rows {
                    acc[i * outputs + c] += w[i] * value;
                }
            }
        }
    }
}

/// `weights[i, j] = tile[i · cols_per_unit + j]` for this unit's rows and columns.
#[cube]
pub fn store_weights(weights: &mut Shared<[f32]>, tile: &Array<f32>, #[comptime] tiling: Tiling) {
    let (rows, cols) = (tiling.rows_per_unit, tiling.cols_per_unit);
    let stride = comptime!(tiling.block_cols() + 1);
    #[unroll]
    for i in 0..rows {
        #[unroll]
        for j in 0..cols {
            weights[block_row(i, tiling) * stride + block_col(j, tiling)] = tile[i * cols + j];
        }
    }
}

/// For each of this unit's rows, the maximum (`max`) or the sum of `parts[i]` over the
/// `col_units` units that share the row, the same in each of them.
#[cube]
pub fn reduce_rows(
    parts: &Array<f32>,
    reduce: &mut Shared<[f32]>,
    #[comptime] max: bool,
    #[comptime] tiling: Tiling,
) -> Array<f32> {
    let (rows, col_units) = (tiling.rows_per_unit, tiling.col_units);
    let (_, unit_col) = unit_place(tiling);
    #[unroll]
    for i in 0..rows {
        reduce[block_row(i, tiling) * col_units + unit_col] = parts[i];
    }
    sync_cube();
    let mut totals = Array::<f32>::new(rows);
    #[unroll]
    for i in 0..rows {
        let at = block_row(i, tiling) * col_units;
        let mut total = reduce[at];
        #[unroll]
        for c in 1..col_units {
            if max {
                total = f32::max(total, reduce[at + c]);
            } else {
                total += reduce[at + c];
            }
        }
        totals[i] = total;
    }
    totals
}

/// `values[i · ⌈width / col_units⌉ + c] · factors[i]` into this unit's rows `i` and columns `c`
/// of `t` (head `head` of batch element `batch`, rows from `first` of `len`), through its
/// strides.
#[allow(clippy::too_many_arguments)]
#[cube]
pub fn store_rows<F: Float>(
    t: &mut Tensor<F>,
    batch: usize,
    head: usize,
    first: usize,
    len: usize,
    values: &Array<f32>,
    factors: &Array<f32>,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let (rows, outputs) = comptime!((tiling.rows_per_unit, tiling.cols_of(width)));
    let (base, row_stride, col_stride) = (
        batch * t.stride(0) + head * t.stride(1),
        t.stride(2),
        t.stride(3),
    );
    #[unroll]
    for i in 0..rows {
        let row = first + block_row(i, tiling);
        #[unroll]
        for c in 0..outputs {
            let col = block_col(c, tiling);
            if row < len && col < width {
                t[base + row * row_stride + col * col_stride] =
                    F::cast_from(values[i * outputs + c] * factors[i]);
            }
        }
    }
}
