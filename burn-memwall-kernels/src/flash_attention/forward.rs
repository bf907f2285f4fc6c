//! The forward kernel: output rows and log-sum-exps of a block of query rows.

use cubecl::prelude::*;

use burn_memwall_codes::dropout::cube::{pair_stream, row_stream};

use super::tiles::{
    Tiling, add_row_products, add_weighted_rows, block_col, block_row, reduce_rows, rows_of,
    store_rows, store_weights, unit_place,
};
use super::{
    AttentionArgs, EMPTY_ROW_LSE, NO_SCORE, block, end_key, filled, first_key, kept, score, shows,
    whole_block,
};

/// Output rows and log-sum-exps of `tiling.block_rows()` query rows per cube. Grid:
/// `(⌈s_q / block_rows⌉, batch · heads)`, `tiling.units()` units per cube.
///
/// Each step takes `block_cols` keys: the score tile `QKᵀ` (staged through shared memory),
/// the row maxima over the units that share a row, the online softmax's rescaling of the
/// unit's output tile and partial sums, then `P V` with the probabilities passed through
/// shared memory. The partial sums meet once, at the end.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn flash_attention_forward_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    hidden: &Tensor<M>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: &AttentionArgs,
    #[comptime] tiling: Tiling,
    #[define(F)] _dtype: ElemType,
    #[define(M)] _mask_dtype: ElemType,
) {
    let (d, d_v) = (args.d.comptime(), args.d_v.comptime());
    let (rows, cols) = comptime!((tiling.rows_per_unit, tiling.cols_per_unit));
    let (block_rows, block_cols) = comptime!((tiling.block_rows(), tiling.block_cols()));
    let outputs = comptime!(tiling.cols_of(d_v));
    let (heads, s_q, s_k) = (q.shape(1), q.shape(2), k.shape(2));
    let owned = block(heads, s_q, block_rows);
    let (pair, batch, head, q_first) = (owned.pair, owned.batch, owned.head, owned.first);
    let kv_head = head / (heads / k.shape(1));
    let queries = rows_of(q, batch, head, q_first, s_q);
    let (_, unit_col) = unit_place(tiling);

    let mut stage = Shared::<[f32]>::new_slice(comptime!(tiling.stage_len(d.max(d_v))));
    let mut weights = Shared::<[f32]>::new_slice(comptime!(tiling.weights_len()));
    let mut reduce = Shared::<[f32]>::new_slice(comptime!(tiling.reduce_len()));

    let mut acc = filled(0.0f32, comptime!(rows * outputs));
    // Partial sums over this unit's columns; they meet at the end. Quiet softmax starts each
    // row with a key of score 0 and value 0, counted once per row.
    let mut max = filled(f32::new(NO_SCORE), rows);
    let mut sum = filled(0.0f32, rows);
    if args.quiet.comptime() {
        #[unroll]
        for i in 0..rows {
            max[i] = 0.0f32;
            sum[i] = select(unit_col == 0, 1.0f32, 0.0f32);
        }
    }
    let mut streams = Array::<u32>::new(rows);
    if args.dropout.comptime() {
        let pair = pair_stream(
            args.dropout_seed,
            u32::cast_from(batch),
            u32::cast_from(head),
        );
        #[unroll]
        for i in 0..rows {
            streams[i] = row_stream(pair, u32::cast_from(q_first + block_row(i, tiling)));
        }
    }

    let mut s = Array::<f32>::new(comptime!(rows * cols));
    let mut k_first = first_key(q_first, args);
    let k_end = end_key(owned.last, s_k, args);
    while k_first < k_end {
        let keys = rows_of(k, batch, kv_head, k_first, s_k);
        #[unroll]
        for t in 0..rows * cols {
            s[t] = 0.0f32;
        }
        add_row_products(&mut s, q, &queries, k, &keys, &mut stage, d, tiling);

        let whole = whole_block(q_first, k_first, s_q, s_k, args, block_rows, block_cols);
        let mut block_max = filled(f32::new(NO_SCORE), rows);
        #[unroll]
        for i in 0..rows {
            #[unroll]
            for j in 0..cols {
                let t = i * cols + j;
                s[t] = score(s[t], args);
                if !whole {
                    let (query, key) = (
                        q_first + block_row(i, tiling),
                        k_first + block_col(j, tiling),
                    );
                    if !shows(hidden, batch, query, key, s_q, s_k, args) {
                        s[t] = f32::new(NO_SCORE);
                    }
                }
                block_max[i] = f32::max(block_max[i], s[t]);
            }
        }
        let block_max = reduce_rows(&block_max, &mut reduce, true, tiling);

        #[unroll]
        for i in 0..rows {
            let new_max = f32::max(max[i], block_max[i]);
            let correction = (max[i] - new_max).exp();
            sum[i] *= correction;
            #[unroll]
            for c in 0..outputs {
                acc[i * outputs + c] *= correction;
            }
            max[i] = new_max;
            #[unroll]
            for j in 0..cols {
                let t = i * cols + j;
                let p = select(s[t] > f32::new(NO_SCORE), (s[t] - new_max).exp(), 0.0f32);
                // Dropout leaves the softmax's sum whole and drops weights from the output.
                sum[i] += p;
                s[t] = p * kept(streams[i], k_first + block_col(j, tiling), args);
            }
        }
        store_weights(&mut weights, &s, tiling);
        let values = rows_of(v, batch, kv_head, k_first, s_k);
        add_weighted_rows(&mut acc, &weights, v, &values, &mut stage, d_v, tiling);
        k_first += block_cols;
    }

    // A row that saw no key outputs zeros; its log-sum-exp is never read back.
    let total = reduce_rows(&sum, &mut reduce, false, tiling);
    let mut inv_total = Array::<f32>::new(rows);
    #[unroll]
    for i in 0..rows {
        inv_total[i] = select(total[i] > 0.0f32, 1.0f32 / total[i], 0.0f32);
        let row = q_first + block_row(i, tiling);
        if unit_col == 0 && row < s_q {
            lse[pair * s_q + row] = select(
                total[i] > 0.0f32,
                max[i] + total[i].ln(),
                f32::new(EMPTY_ROW_LSE),
            );
        }
    }
    store_rows(
        out, batch, head, q_first, s_q, &acc, &inv_total, d_v, tiling,
    );
}
