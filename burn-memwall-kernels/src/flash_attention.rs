//! Flash attention kernels: `softmax(QKᵀ·scale + mask) V` and its gradients without an
//! `[s_q, s_k]` matrix anywhere.
//!
//! A unit owns `rows` rows (comptime) and keeps their accumulators in registers, so that each
//! element it loads from the other side serves `rows` rows. A cube owns a tile of
//! `CUBE_DIM_X · rows` consecutive rows of one (batch, head) pair (unit `u` owns rows `u`,
//! `u + CUBE_DIM_X`, …) and walks the keys (or queries) its tile sees in one loop shared by all
//! its units, each unit zeroing what its own rows must not see: every load of that loop has
//! the same address in every unit, which a GPU serves as one broadcast.
//!
//! Launch: `cube_dim = (units, 1, 1)`, `cube_count = (⌈rows in the sequence / (units · rows)⌉,
//! pairs, 1)` with the sequence and the pairs as each kernel says.
//! - [`flash_attention_forward_kernel()`]: a query row, walking its visible keys with an online
//!   softmax; writes the output row and the row's log-sum-exp;
//! - [`flash_attention_query_grad_kernel()`]: a query row again, recomputing each probability from
//!   the log-sum-exp; writes dQ and `delta = rowsum(dO ∘ O)`;
//! - [`flash_attention_key_grad_kernel()`]: a key row, walking every query (of every head of its
//!   group) that sees it; writes dK and dV. Splitting dQ from dK/dV is FlashAttention-2's way
//!   to avoid atomics: each output row has exactly one writer.
//!
//! Layouts: q, d_out `[batch, heads, s_q, d]`, k, v `[batch, kv_heads, s_k, d]` read through
//! their strides (the transposed views an attention layer makes need no copy); `hidden`
//! `[batch or 1, s_q or 1, s_k]` in the runtime's bool storage `M`, nonzero where a query must
//! not see a key (a key padding mask is `[batch, 1, s_k]`), read through its strides; lse and
//! delta `[batch·heads·s_q]` in f32, contiguous; the output and the gradients are written
//! through their strides (the caller lays the output out `[batch, s_q, heads, d_v]` in memory,
//! so that merging its heads is free). Arithmetic is f32 whatever the storage type `F`.
//!
//! Visibility: query `i` sits at key position `i + offset` (`offset = s_k − s_q`, a KV cache's
//! alignment). Causal: keys up to that position. `window > 0`: only the last `window` of them.
//! The loops cover only the positions a tile's rows can see; within them, a key (or query) that
//! the mask hides from all of a unit's rows costs that unit no dot product.
//!
//! Dropout (of the attention weights, as Burn's attention applies it): the forward drops a
//! weight from the output but not from the softmax's sum; the backward regenerates the same
//! keep-mask from the counter-based draw of `burn_memwall_codes::dropout` and scales `dP` by it.
//! `delta = rowsum(dO ∘ O)` still equals `rowsum(P ∘ dP)`, so nothing more is saved.
//!
//! Every kernel takes the same [`AttentionArgs`]: the scalars of one attention, runtime and
//! comptime together, so that a new option is one field rather than a parameter in each kernel.

use cubecl::prelude::*;

use burn_memwall_codes::dropout::cube::{keeps, pair_stream, row_stream};

use crate::softcap::{soft_cap, soft_cap_slope};

/// The log-sum-exp written for a query that sees no key. Such a row outputs zeros and its
/// log-sum-exp is never read back; a finite value keeps WGSL, which rejects an infinite
/// literal, happy.
pub const EMPTY_ROW_LSE: f32 = 3.0e38;

/// Below every real score, so the first visible key always becomes the running maximum.
const NO_SCORE: f32 = -3.0e38;

/// The scalars of one attention, shared by its three kernels.
#[derive(CubeType, CubeLaunch, Clone)]
pub struct AttentionArgs {
    /// Multiplies `q · k` before the soft-cap.
    pub scale: f32,
    /// The `c` of `c · tanh(s / c)`; read only when `softcapped`.
    pub softcap: f32,
    /// `s_k − s_q`: the key position of query 0.
    pub offset: i32,
    /// How many keys back from its own position a query sees; 0 for no window.
    pub window: u32,
    /// The dropout draw's folded seed (`burn_memwall_codes::dropout::DropoutDraw`); read only
    /// with `dropout`, as are the next two.
    pub dropout_seed: u32,
    /// A key is kept when its draw is at least this.
    pub dropout_threshold: u32,
    /// `1 / (1 − p)`: what a kept weight is multiplied by.
    pub dropout_scale: f32,
    /// Width of the q and k rows.
    #[cube(comptime)]
    pub d: usize,
    /// Width of the v rows.
    #[cube(comptime)]
    pub d_v: usize,
    /// Rows each unit owns.
    #[cube(comptime)]
    pub rows: usize,
    /// Keys up to the query's position only; set whenever `window > 0`, whose bounds rely on it.
    #[cube(comptime)]
    pub causal: bool,
    /// Whether the scores are soft-capped.
    #[cube(comptime)]
    pub softcapped: bool,
    /// Quiet softmax: `exp(s_j) / (1 + Σ exp(s_k))`, as if every row also saw a key of score 0
    /// and value 0.
    #[cube(comptime)]
    pub quiet: bool,
    /// Whether the attention weights are dropped out.
    #[cube(comptime)]
    pub dropout: bool,
}

/// The score of a dot product `q · k`: scaled, then soft-capped when asked.
#[cube]
fn score(dot: f32, args: &AttentionArgs) -> f32 {
    soft_cap(dot * args.scale, args.softcap, args.softcapped.comptime())
}

/// `∂score/∂(scaled dot)` written with the score itself.
#[cube]
fn score_slope(score: f32, args: &AttentionArgs) -> f32 {
    soft_cap_slope(score, args.softcap, args.softcapped.comptime())
}

/// The dropout streams of this unit's query rows of head `head` of batch element `batch`; not
/// drawn without dropout.
#[cube]
fn row_streams(
    tile: &Tile,
    batch: usize,
    head: usize,
    args: &AttentionArgs,
    #[comptime] rows: usize,
) -> Array<u32> {
    let mut streams = Array::<u32>::new(rows);
    if args.dropout.comptime() {
        let pair = pair_stream(
            args.dropout_seed,
            u32::cast_from(batch),
            u32::cast_from(head),
        );
        #[unroll]
        for r in 0..rows {
            streams[r] = row_stream(pair, u32::cast_from(unit_row(tile, r)));
        }
    }
    streams
}

/// What dropout multiplies the weight of key `key` by in the row of `stream`: `1 / (1 − p)`
/// where it keeps the key, 0 where it drops it, 1 without dropout.
#[cube]
fn kept(stream: u32, key: usize, args: &AttentionArgs) -> f32 {
    let mut factor = 1.0f32;
    if args.dropout.comptime() {
        factor = select(
            keeps(stream, u32::cast_from(key), args.dropout_threshold),
            args.dropout_scale,
            0.0f32,
        );
    }
    factor
}

/// First key that query `query` sees.
#[cube]
fn first_key(query: usize, args: &AttentionArgs) -> usize {
    let mut first = 0i32;
    if args.window > 0 {
        first = i32::cast_from(query) + args.offset - i32::cast_from(args.window) + 1;
    }
    if first < 0 {
        first = 0;
    }
    usize::cast_from(first)
}

/// One past the last key that query `query` sees.
#[cube]
fn end_key(query: usize, s_k: usize, args: &AttentionArgs) -> usize {
    let mut end = s_k;
    if args.causal.comptime() {
        let mut last = i32::cast_from(query) + args.offset + 1;
        if last < 0 {
            last = 0;
        }
        end = min(usize::cast_from(last), s_k);
    }
    end
}

/// Whether query `query` sees key `key` by position.
#[cube]
fn sees(query: usize, key: usize, s_k: usize, args: &AttentionArgs) -> bool {
    key >= first_key(query, args) && key < end_key(query, s_k, args)
}

/// First query that sees key `key` (the inverse of [`end_key`]).
#[cube]
fn first_query(key: usize, args: &AttentionArgs) -> usize {
    let mut first = 0i32;
    if args.causal.comptime() {
        first = i32::cast_from(key) - args.offset;
    }
    if first < 0 {
        first = 0;
    }
    usize::cast_from(first)
}

/// One past the last query that sees key `key` (the inverse of [`first_key`]).
#[cube]
fn end_query(key: usize, s_q: usize, args: &AttentionArgs) -> usize {
    let mut end = s_q;
    if args.window > 0 {
        let mut last = i32::cast_from(key) - args.offset + i32::cast_from(args.window);
        if last < 0 {
            last = 0;
        }
        end = min(usize::cast_from(last), s_q);
    }
    end
}

/// Whether the mask `hidden` `[batch or 1, s_q or 1, s_k]` shows key `key` to query `query` of
/// batch element `batch`.
#[cube]
fn mask_shows<M: Numeric>(hidden: &Tensor<M>, batch: usize, query: usize, key: usize) -> bool {
    let batch = select(hidden.shape(0) == 1, 0, batch);
    let query = select(hidden.shape(1) == 1, 0, query);
    hidden[batch * hidden.stride(0) + query * hidden.stride(1) + key * hidden.stride(2)]
        == M::from_int(0)
}

/// Offset of row `row` of head `head` of batch element `batch` in a rank-4 tensor.
#[cube]
fn row_at<F: Float>(t: &Tensor<F>, batch: usize, head: usize, row: usize) -> usize {
    batch * t.stride(0) + head * t.stride(1) + row * t.stride(2)
}

/// The tile of rows a cube owns: one (batch, head) pair, `CUBE_DIM_X · rows` consecutive rows.
#[derive(CubeType)]
struct Tile {
    /// `batch · heads + head` (or `batch · kv_heads + kv_head` for key tiles).
    pair: usize,
    /// First and last row of the tile within the sequence of `len` rows.
    first: usize,
    last: usize,
    len: usize,
}

#[cube]
fn tile(len: usize, #[comptime] rows: usize) -> Tile {
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize * rows;
    Tile {
        pair: CUBE_POS_Y as usize,
        first,
        last: min(first + CUBE_DIM_X as usize * rows, len) - 1,
        len,
    }
}

/// The `r`-th row of this unit. Past the sequence's end it is the last row again, computed and
/// never written, so that every unit runs the tile's loop.
#[cube]
fn unit_row(tile: &Tile, r: usize) -> usize {
    min(
        tile.first + UNIT_POS_X as usize + r * CUBE_DIM_X as usize,
        tile.len - 1,
    )
}

#[cube]
fn unit_writes(tile: &Tile, r: usize) -> bool {
    tile.first + UNIT_POS_X as usize + r * (CUBE_DIM_X as usize) < tile.len
}

/// This unit's rows of `t` (`batch`, `head`), `len` elements each, as f32 registers.
#[cube]
fn load_rows<F: Float>(
    t: &Tensor<F>,
    tile: &Tile,
    batch: usize,
    head: usize,
    #[comptime] len: usize,
    #[comptime] rows: usize,
) -> Array<f32> {
    let mut registers = Array::<f32>::new(rows * len);
    let stride = t.stride(3);
    #[unroll]
    for r in 0..rows {
        let at = row_at(t, batch, head, unit_row(tile, r));
        #[unroll]
        for c in 0..len {
            registers[r * len + c] = f32::cast_from(t[at + c * stride]);
        }
    }
    registers
}

/// `values[r · len + c] · factors[r]` into this unit's rows of `t`, through its strides.
#[cube]
fn store_rows<F: Float>(
    t: &mut Tensor<F>,
    tile: &Tile,
    values: &Array<f32>,
    factors: &Array<f32>,
    #[comptime] len: usize,
    #[comptime] rows: usize,
) {
    let (batch, head) = (tile.pair / t.shape(1), tile.pair % t.shape(1));
    let stride = t.stride(3);
    #[unroll]
    for r in 0..rows {
        if unit_writes(tile, r) {
            // `row_at`'s offset: a cube function cannot lend a `&mut` tensor as `&`.
            let at = batch * t.stride(0) + head * t.stride(1) + unit_row(tile, r) * t.stride(2);
            #[unroll]
            for c in 0..len {
                t[at + c * stride] = F::cast_from(values[r * len + c] * factors[r]);
            }
        }
    }
}

/// `shown[r]` = 1 where this unit's row `r` and `other` see each other (by position and by the
/// mask), else 0; returns whether any does. The rows are queries and `other` a key, or with
/// `rows_are_keys` the other way round.
#[allow(clippy::too_many_arguments)]
#[cube]
fn shown_to_rows<M: Numeric>(
    shown: &mut Array<f32>,
    tile: &Tile,
    hidden: &Tensor<M>,
    batch: usize,
    other: usize,
    s_k: usize,
    args: &AttentionArgs,
    #[comptime] rows: usize,
    #[comptime] rows_are_keys: bool,
) -> bool {
    let mut any_shown = false;
    #[unroll]
    for r in 0..rows {
        let mut query = unit_row(tile, r);
        let mut key = other;
        if rows_are_keys {
            key = query;
            query = other;
        }
        let visible = sees(query, key, s_k, args) && mask_shows(hidden, batch, query, key);
        shown[r] = select(visible, 1.0f32, 0.0f32);
        any_shown = any_shown || visible;
    }
    any_shown
}

#[cube]
fn filled(value: f32, #[comptime] len: usize) -> Array<f32> {
    let mut registers = Array::<f32>::new(len);
    #[unroll]
    for c in 0..len {
        registers[c] = value;
    }
    registers
}

/// `out[r] = registers[r · len ..] · t[at ..]` for each of the unit's rows: one load of `t`
/// serves every row.
#[cube]
fn dots<F: Float>(
    registers: &Array<f32>,
    t: &Tensor<F>,
    at: usize,
    out: &mut Array<f32>,
    #[comptime] len: usize,
    #[comptime] rows: usize,
) {
    let stride = t.stride(3);
    #[unroll]
    for r in 0..rows {
        out[r] = 0.0f32;
    }
    #[unroll]
    for c in 0..len {
        let element = f32::cast_from(t[at + c * stride]);
        #[unroll]
        for r in 0..rows {
            out[r] += registers[r * len + c] * element;
        }
    }
}

/// `registers[r · len ..] += weights[r] · t[at ..]` for each of the unit's rows.
#[cube]
fn add_outer<F: Float>(
    registers: &mut Array<f32>,
    weights: &Array<f32>,
    t: &Tensor<F>,
    at: usize,
    #[comptime] len: usize,
    #[comptime] rows: usize,
) {
    let stride = t.stride(3);
    #[unroll]
    for c in 0..len {
        let element = f32::cast_from(t[at + c * stride]);
        #[unroll]
        for r in 0..rows {
            registers[r * len + c] += weights[r] * element;
        }
    }
}

/// Output rows and log-sum-exps of query rows. Sequence: `s_q`; pairs: `batch · heads`.
#[cube(launch)]
pub fn flash_attention_forward_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    hidden: &Tensor<M>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: &AttentionArgs,
    #[define(F)] _dtype: ElemType,
    #[define(M)] _mask_dtype: ElemType,
) {
    let (d, d_v, rows) = (args.d.comptime(), args.d_v.comptime(), args.rows.comptime());
    let (heads, s_k) = (q.shape(1), k.shape(2));
    let tile = tile(q.shape(2), rows);
    let (batch, head) = (tile.pair / heads, tile.pair % heads);
    let kv_head = head / (heads / k.shape(1));

    let q_rows = load_rows(q, &tile, batch, head, d, rows);
    let mut acc = filled(0.0f32, rows * d_v);
    let mut max = filled(f32::new(NO_SCORE), rows);
    let mut sum = filled(0.0f32, rows);
    if args.quiet.comptime() {
        // The zero-score key of value 0, seen first.
        max = filled(0.0f32, rows);
        sum = filled(1.0f32, rows);
    }
    let streams = row_streams(&tile, batch, head, args, rows);
    let mut p = Array::<f32>::new(rows);
    let mut shown = Array::<f32>::new(rows);
    for j in first_key(tile.first, args)..end_key(tile.last, s_k, args) {
        if shown_to_rows(&mut shown, &tile, hidden, batch, j, s_k, args, rows, false) {
            dots(&q_rows, k, row_at(k, batch, kv_head, j), &mut p, d, rows);
            #[unroll]
            for r in 0..rows {
                let visible = shown[r] > 0.0f32;
                let s = score(p[r], args);
                if visible && s > max[r] {
                    let correction = (max[r] - s).exp();
                    sum[r] *= correction;
                    #[unroll]
                    for c in 0..d_v {
                        acc[r * d_v + c] *= correction;
                    }
                    max[r] = s;
                }
                p[r] = select(visible, (s - max[r]).exp(), 0.0f32);
                sum[r] += p[r];
                p[r] *= kept(streams[r], j, args);
            }
            add_outer(&mut acc, &p, v, row_at(v, batch, kv_head, j), d_v, rows);
        }
    }

    // A row that saw no key outputs zeros; its log-sum-exp is never read back.
    let mut inv_sum = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        inv_sum[r] = select(sum[r] > 0.0f32, 1.0f32 / sum[r], 0.0f32);
        if unit_writes(&tile, r) {
            lse[tile.pair * tile.len + unit_row(&tile, r)] = select(
                sum[r] > 0.0f32,
                max[r] + sum[r].ln(),
                f32::new(EMPTY_ROW_LSE),
            );
        }
    }
    store_rows(out, &tile, &acc, &inv_sum, d_v, rows);
}

/// dQ of query rows, and their `delta = rowsum(dO ∘ O)` for the key kernel. Sequence: `s_q`;
/// pairs: `batch · heads`.
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
    #[define(F)] _dtype: ElemType,
    #[define(M)] _mask_dtype: ElemType,
) {
    let (d, d_v, rows) = (args.d.comptime(), args.d_v.comptime(), args.rows.comptime());
    let (heads, s_k) = (q.shape(1), k.shape(2));
    let tile = tile(q.shape(2), rows);
    let (batch, head) = (tile.pair / heads, tile.pair % heads);
    let kv_head = head / (heads / k.shape(1));

    let q_rows = load_rows(q, &tile, batch, head, d, rows);
    let d_out_rows = load_rows(d_out, &tile, batch, head, d_v, rows);
    let mut row_delta = Array::<f32>::new(rows);
    let mut row_lse = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        let (out_at, stride) = (row_at(out, batch, head, unit_row(&tile, r)), out.stride(3));
        let mut sum = 0.0f32;
        #[unroll]
        for c in 0..d_v {
            sum += d_out_rows[r * d_v + c] * f32::cast_from(out[out_at + c * stride]);
        }
        row_delta[r] = sum;
        row_lse[r] = lse[tile.pair * tile.len + unit_row(&tile, r)];
    }

    let streams = row_streams(&tile, batch, head, args, rows);
    let mut dq_acc = filled(0.0f32, rows * d);
    let mut ds = Array::<f32>::new(rows);
    let mut dp = Array::<f32>::new(rows);
    let mut shown = Array::<f32>::new(rows);
    for j in first_key(tile.first, args)..end_key(tile.last, s_k, args) {
        if shown_to_rows(&mut shown, &tile, hidden, batch, j, s_k, args, rows, false) {
            let k_at = row_at(k, batch, kv_head, j);
            dots(&q_rows, k, k_at, &mut ds, d, rows);
            dots(
                &d_out_rows,
                v,
                row_at(v, batch, kv_head, j),
                &mut dp,
                d_v,
                rows,
            );
            #[unroll]
            for r in 0..rows {
                let s = score(ds[r], args);
                let p = select(shown[r] > 0.0f32, (s - row_lse[r]).exp(), 0.0f32);
                ds[r] =
                    p * (dp[r] * kept(streams[r], j, args) - row_delta[r]) * score_slope(s, args);
            }
            add_outer(&mut dq_acc, &ds, k, k_at, d, rows);
        }
    }
    #[unroll]
    for r in 0..rows {
        if unit_writes(&tile, r) {
            delta[tile.pair * tile.len + unit_row(&tile, r)] = row_delta[r];
        }
    }
    store_rows(dq, &tile, &dq_acc, &filled(args.scale, rows), d, rows);
}

/// dK and dV of key rows, summed over every query of every head in their group that sees them.
/// Sequence: `s_k`; pairs: `batch · kv_heads`.
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
    #[comptime] group: usize,
    #[define(F)] _dtype: ElemType,
    #[define(M)] _mask_dtype: ElemType,
) {
    let (d, d_v, rows) = (args.d.comptime(), args.d_v.comptime(), args.rows.comptime());
    let (heads, s_q) = (q.shape(1), q.shape(2));
    let (kv_heads, s_k) = (k.shape(1), k.shape(2));
    let tile = tile(s_k, rows);
    let (batch, kv_head) = (tile.pair / kv_heads, tile.pair % kv_heads);

    let k_rows = load_rows(k, &tile, batch, kv_head, d, rows);
    let v_rows = load_rows(v, &tile, batch, kv_head, d_v, rows);
    let mut dk_acc = filled(0.0f32, rows * d);
    let mut dv_acc = filled(0.0f32, rows * d_v);
    let mut p = Array::<f32>::new(rows);
    let mut shown = Array::<f32>::new(rows);
    let mut ds = Array::<f32>::new(rows);
    let queries_first = first_query(tile.first, args);
    let queries_end = end_query(tile.last, s_q, args);
    // Unrolled so that each head's query loop is a loop of its own: lavapipe (Mesa's software
    // Vulkan) silently ends a loop nest after 65535 iterations in total.
    #[unroll]
    for g in 0..group {
        let head = kv_head * group + g;
        let pair = pair_stream(
            args.dropout_seed,
            u32::cast_from(batch),
            u32::cast_from(head),
        );
        for i in queries_first..queries_end {
            if shown_to_rows(&mut shown, &tile, hidden, batch, i, s_k, args, rows, true) {
                let query = (batch * heads + head) * s_q + i;
                let (q_at, d_out_at) = (row_at(q, batch, head, i), row_at(d_out, batch, head, i));
                dots(&k_rows, q, q_at, &mut p, d, rows);
                dots(&v_rows, d_out, d_out_at, &mut ds, d_v, rows);
                let stream = row_stream(pair, u32::cast_from(i));
                #[unroll]
                for r in 0..rows {
                    let s = score(p[r], args);
                    p[r] = select(shown[r] > 0.0f32, (s - lse[query]).exp(), 0.0f32);
                    let kept = kept(stream, unit_row(&tile, r), args);
                    ds[r] = p[r] * (ds[r] * kept - delta[query]) * score_slope(s, args);
                    p[r] *= kept;
                }
                add_outer(&mut dv_acc, &p, d_out, d_out_at, d_v, rows);
                add_outer(&mut dk_acc, &ds, q, q_at, d, rows);
            }
        }
    }
    store_rows(dk, &tile, &dk_acc, &filled(args.scale, rows), d, rows);
    store_rows(dv, &tile, &dv_acc, &filled(1.0f32, rows), d_v, rows);
}
