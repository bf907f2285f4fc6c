//! The key-gradient kernel: dK and dV of a block of key rows.

use cubecl::prelude::*;

use burn_memwall_codes::dropout::cube::{pair_stream, row_stream};

use super::tiles::{
    Tiling, add_row_products, add_weighted_rows, block_col, block_row, rows_of, store_rows,
    store_weights,
};
use super::{
    AttentionArgs, block, end_query, filled, first_query, kept, score, score_slope, shows,
    whole_block,
};

/// dK and dV of `tiling.block_rows()` key rows per cube, summed over every query of every head
/// in their group that sees them. Grid: `(⌈s_k / block_rows⌉, batch · kv_heads)`,
/// `tiling.units()` units per cube.
///
/// The rows of this kernel are keys and its steps take `block_cols` queries: the tiles `K Qᵀ`
/// and `V dOᵀ`, then `dV += (P ∘ Z)ᵀ dO` and `dK += dSᵀ Q`, each weight tile passed through
/// shared memory (`Z` dropout's factors).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn flash_attention_key_grad_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    hidden: &Tensor<M>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    args: &AttentionArgs,
    #[comptime] tiling: Tiling,
    #[define(F)] _dtype: ElemType,
    #[define(M)] _mask_dtype: ElemType,
) {
    let (d, d_v) = (args.d.comptime(), args.d_v.comptime());
    let (rows, cols) = comptime!((tiling.rows_per_unit, tiling.cols_per_unit));
    let (block_rows, block_cols) = comptime!((tiling.block_rows(), tiling.block_cols()));
    let (dk_cols, dv_cols) = comptime!((tiling.cols_of(d), tiling.cols_of(d_v)));
    let (heads, s_q) = (q.shape(1), q.shape(2));
    let (kv_heads, s_k) = (k.shape(1), k.shape(2));
    let group = heads / kv_heads;
    let owned = block(kv_heads, s_k, block_rows);
    let (batch, kv_head, k_first) = (owned.batch, owned.head, owned.first);
    let keys = rows_of(k, batch, kv_head, k_first, s_k);
    let values = rows_of(v, batch, kv_head, k_first, s_k);

    let mut stage = Shared::<[f32]>::new_slice(comptime!(tiling.stage_len(d.max(d_v))));
    let mut weights = Shared::<[f32]>::new_slice(comptime!(tiling.weights_len()));

    let mut dk_acc = filled(0.0f32, comptime!(rows * dk_cols));
    let mut dv_acc = filled(0.0f32, comptime!(rows * dv_cols));
    let mut p = Array::<f32>::new(comptime!(rows * cols));
    let mut ds = Array::<f32>::new(comptime!(rows * cols));
    let mut col_lse = Array::<f32>::new(cols);
    let mut col_delta = Array::<f32>::new(cols);
    let mut streams = Array::<u32>::new(cols);
    let (q_begin, q_end) = (first_query(k_first, args), end_query(owned.last, s_q, args));
    for g in 0..group {
        let head = kv_head * group + g;
        let q_pair = batch * heads + head;
        let dropout_pair = pair_stream(
            args.dropout_seed,
            u32::cast_from(batch),
            u32::cast_from(head),
        );
        let mut q_first = q_begin;
        while q_first < q_end {
            let queries = rows_of(q, batch, head, q_first, s_q);
            let gradients = rows_of(d_out, batch, head, q_first, s_q);
            #[unroll]
            for t in 0..rows * cols {
                p[t] = 0.0f32;
                ds[t] = 0.0f32;
            }
            add_row_products(&mut p, k, &keys, q, &queries, &mut stage, d, tiling);
            add_row_products(
                &mut ds, v, &values, d_out, &gradients, &mut stage, d_v, tiling,
            );

            #[unroll]
            for j in 0..cols {
                let query = q_first + block_col(j, tiling);
                col_lse[j] = 0.0f32;
                col_delta[j] = 0.0f32;
                if query < s_q {
                    col_lse[j] = lse[q_pair * s_q + query];
                    col_delta[j] = delta[q_pair * s_q + query];
                }
                if args.dropout.comptime() {
                    streams[j] = row_stream(dropout_pair, u32::cast_from(query));
                }
            }
            let whole = whole_block(q_first, k_first, s_q, s_k, args, block_cols, block_rows);
            #[unroll]
            for i in 0..rows {
                let key = k_first + block_row(i, tiling);
                #[unroll]
                for j in 0..cols {
                    let t = i * cols + j;
                    let s = score(p[t], args);
                    let mut probability = (s - col_lse[j]).exp();
                    if !whole {
                        let query = q_first + block_col(j, tiling);
                        probability = select(
                            shows(hidden, batch, query, key, s_q, s_k, args),
                            probability,
                            0.0f32,
                        );
                    }
                    let kept = kept(streams[j], key, args);
                    ds[t] = probability * (ds[t] * kept - col_delta[j]) * score_slope(s, args);
                    p[t] = probability * kept;
                }
            }
            store_weights(&mut weights, &p, tiling);
            add_weighted_rows(
                &mut dv_acc,
                &weights,
                d_out,
                &gradients,
                &mut stage,
                d_v,
                tiling,
            );
            // Every unit has read the dropped probabilities before they are overwritten.
            sync_cube();
            store_weights(&mut weights, &ds, tiling);
            add_weighted_rows(&mut dk_acc, &weights, q, &queries, &mut stage, d, tiling);
            q_first += block_cols;
        }
    }
    store_rows(
        dk,
        batch,
        kv_head,
        k_first,
        s_k,
        &dk_acc,
        &filled(args.scale, rows),
        d,
        tiling,
    );
    store_rows(
        dv,
        batch,
        kv_head,
        k_first,
        s_k,
        &dv_acc,
        &filled(1.0f32, rows),
        d_v,
        tiling,
    );
}
