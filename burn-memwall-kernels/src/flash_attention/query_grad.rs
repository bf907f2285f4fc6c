//! The query-gradient kernel: dQ of a block of query rows, and their `delta = rowsum(dO ∘ O)`.

use cubecl::prelude::*;

use burn_memwall_codes::dropout::cube::{pair_stream, row_stream};

use super::tiles::{
    Tiling, add_row_products, add_weighted_rows, block_col, block_row, reduce_rows, rows_of,
    store_rows, store_weights,
};
use super::{
    AttentionArgs, block, end_key, filled, first_key, kept, score, score_slope, shows, whole_block,
};

/// dQ of `tiling.block_rows()` query rows per cube, and their `delta = rowsum(dO ∘ O)` for the
/// key kernel. Grid: `(⌈s_q / block_rows⌉, batch · heads)`, `tiling.units()` units per cube.
///
/// Each step takes `block_cols` keys: the tiles `QKᵀ` and `dO Vᵀ`, then
/// `dS = P ∘ (dP − delta)` (with dropout's factors and the soft-cap's slope) and `dS K` with
/// `dS` passed through shared memory.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn flash_attention_query_grad_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    hidden: &Tensor<M>,
    out: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dq: &mut Tensor<F>,
    args: &AttentionArgs,
    #[comptime] tiling: Tiling,
    #[define(F)] _dtype: ElemType,
    #[define(M)] _mask_dtype: ElemType,
) {
    let (d, d_v) = (args.d.comptime(), args.d_v.comptime());
    let (rows, cols) = comptime!((tiling.rows_per_unit, tiling.cols_per_unit));
    let (block_rows, block_cols) = comptime!((tiling.block_rows(), tiling.block_cols()));
    let (outputs, d_out_cols) = comptime!((tiling.cols_of(d), tiling.cols_of(d_v)));
    let (heads, s_q, s_k) = (q.shape(1), q.shape(2), k.shape(2));
    let owned = block(heads, s_q, block_rows);
    let (pair, batch, head, q_first) = (owned.pair, owned.batch, owned.head, owned.first);
    let kv_head = head / (heads / k.shape(1));
    let queries = rows_of(q, batch, head, q_first, s_q);
    let gradients = rows_of(d_out, batch, head, q_first, s_q);

    let mut stage = Shared::<[f32]>::new_slice(comptime!(tiling.stage_len(d.max(d_v))));
    let mut weights = Shared::<[f32]>::new_slice(comptime!(tiling.weights_len()));
    let mut reduce = Shared::<[f32]>::new_slice(comptime!(tiling.reduce_len()));

    // delta over this unit's columns of its rows, then over the units sharing each row.
    let mut parts = filled(0.0f32, rows);
    let mut row_lse = filled(0.0f32, rows);
    #[unroll]
    for i in 0..rows {
        let row = q_first + block_row(i, tiling);
        if row < s_q {
            let (out_at, d_out_at) = (
                batch * out.stride(0) + head * out.stride(1) + row * out.stride(2),
                gradients.base + row * d_out.stride(2),
            );
            #[unroll]
            for c in 0..d_out_cols {
                let col = block_col(c, tiling);
                if col < d_v {
                    parts[i] += f32::cast_from(d_out[d_out_at + col * d_out.stride(3)])
                        * f32::cast_from(out[out_at + col * out.stride(3)]);
                }
            }
            row_lse[i] = lse[pair * s_q + row];
        }
    }
    let row_delta = reduce_rows(&parts, &mut reduce, false, tiling);
    let mut streams = Array::<u32>::new(rows);
    let dropout_pair = pair_stream(
        args.dropout_seed,
        u32::cast_from(batch),
        u32::cast_from(head),
    );
    #[unroll]
    for i in 0..rows {
        let row = q_first + block_row(i, tiling);
        if block_col(0, tiling) == 0 && row < s_q {
            delta[pair * s_q + row] = row_delta[i];
        }
        if args.dropout.comptime() {
            streams[i] = row_stream(dropout_pair, u32::cast_from(row));
        }
    }

    let mut acc = filled(0.0f32, comptime!(rows * outputs));
    let mut ds = Array::<f32>::new(comptime!(rows * cols));
    let mut dp = Array::<f32>::new(comptime!(rows * cols));
    let mut k_first = first_key(q_first, args);
    let k_end = end_key(owned.last, s_k, args);
    while k_first < k_end {
        let (keys, values) = (
            rows_of(k, batch, kv_head, k_first, s_k),
            rows_of(v, batch, kv_head, k_first, s_k),
        );
        #[unroll]
        for t in 0..rows * cols {
            ds[t] = 0.0f32;
            dp[t] = 0.0f32;
        }
        add_row_products(&mut ds, q, &queries, k, &keys, &mut stage, d, tiling);
        add_row_products(
            &mut dp, d_out, &gradients, v, &values, &mut stage, d_v, tiling,
        );

        let whole = whole_block(q_first, k_first, s_q, s_k, args, block_rows, block_cols);
        #[unroll]
        for i in 0..rows {
            #[unroll]
            for j in 0..cols {
                let t = i * cols + j;
                let key = k_first + block_col(j, tiling);
                let s = score(ds[t], args);
                let mut p = (s - row_lse[i]).exp();
                if !whole {
                    let query = q_first + block_row(i, tiling);
                    p = select(shows(hidden, batch, query, key, s_q, s_k, args), p, 0.0f32);
                }
                ds[t] =
                    p * (dp[t] * kept(streams[i], key, args) - row_delta[i]) * score_slope(s, args);
            }
        }
        store_weights(&mut weights, &ds, tiling);
        add_weighted_rows(&mut acc, &weights, k, &keys, &mut stage, d, tiling);
        k_first += block_cols;
    }
    store_rows(
        dq,
        batch,
        head,
        q_first,
        s_q,
        &acc,
        &filled(args.scale, rows),
        d,
        tiling,
    );
}
