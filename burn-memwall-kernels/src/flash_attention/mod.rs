//! Flash attention kernels: `softmax(QKᵀ·scale + mask) V` and its gradients without an
//! `[s_q, s_k]` matrix anywhere, shaped the way GPUs run fast (FlashAttention-2).
//!
//! A cube owns a block of rows of one (batch, head) pair and walks the blocks of the other side
//! that its rows see. Each step stages the other side's block in shared memory with coalesced
//! loads, so that every element loaded from global memory feeds a whole block of rows; each unit
//! keeps a small register tile of the step's scores and of its share of the output
//! ([`tiles`] says who owns what). Row maxima and sums meet in shared memory.
//! - [`flash_attention_forward_kernel()`]: a block of query rows, walking its visible key
//!   blocks with an online softmax; writes the output rows and their log-sum-exps;
//! - [`flash_attention_query_grad_kernel()`]: a block of query rows again, recomputing each
//!   probability from the log-sum-exp; writes dQ and `delta = rowsum(dO ∘ O)`;
//! - [`flash_attention_key_grad_kernel()`]: a block of key rows, walking every query block (of
//!   every head of its group) that sees it; writes dK and dV. Splitting dQ from dK/dV is
//!   FlashAttention-2's way to avoid atomics: each output row has exactly one writer.
//!
//! [`plan`] chooses the tiling of each kernel from the runtime's limits and the head widths,
//! and computes its launch plan (registers, shared bytes, cubes, reuse), the proxy for speed
//! that can be checked without a GPU.
//!
//! Layouts: q, d_out `[batch, heads, s_q, d]`, k, v `[batch, kv_heads, s_k, d]` read through
//! their strides (the transposed views an attention layer makes need no copy); `hidden`
//! `[batch or 1, s_q or 1, s_k]` in the runtime's bool storage `M`, nonzero where a query must
//! not see a key (a key padding mask is `[batch, 1, s_k]`), read through its strides and only
//! when `masked`; lse and delta `[batch·heads·s_q]` in f32, contiguous; the output and the
//! gradients are written through their strides (the caller lays the output out
//! `[batch, s_q, heads, d_v]` in memory, so that merging its heads is free). Arithmetic is f32
//! whatever the storage type `F`.
//!
//! Visibility: query `i` sits at key position `i + offset` (`offset = s_k − s_q`, a KV cache's
//! alignment). Causal: keys up to that position. `window > 0`: only the last `window` of them.
//! The loops cover only the blocks a block of rows can see; a block that every row sees whole
//! (and no mask) checks nothing per element.
//!
//! Dropout (of the attention weights, as Burn's attention applies it): the forward drops a
//! weight from the output but not from the softmax's sum; the backward regenerates the same
//! keep-mask from the counter-based draw of `burn_memwall_codes::dropout` and scales `dP` by it.
//! `delta = rowsum(dO ∘ O)` still equals `rowsum(P ∘ dP)`, so nothing more is saved.
//!
//! Every kernel takes the same [`AttentionArgs`]: the scalars of one attention, runtime and
//! comptime together, so that a new option is one field rather than a parameter in each kernel.

mod forward;
mod key_grad;
pub mod plan;
mod query_grad;
pub mod tiles;

pub use forward::flash_attention_forward_kernel;
pub use key_grad::flash_attention_key_grad_kernel;
pub use query_grad::flash_attention_query_grad_kernel;

use cubecl::prelude::*;

use burn_memwall_codes::dropout::cube::keeps;

use crate::softcap::{soft_cap, soft_cap_slope};

/// The log-sum-exp written for a query that sees no key. Such a row outputs zeros and its
/// log-sum-exp is never read back; a finite value keeps WGSL, which rejects an infinite
/// literal, happy.
pub const EMPTY_ROW_LSE: f32 = 3.0e38;

/// The score of a hidden key, below every real score: the running maximum of a row starts
/// here, and a probability is taken only of a score above it.
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
    /// Keys up to the query's position only; set whenever `window > 0`, whose bounds rely on it.
    #[cube(comptime)]
    pub causal: bool,
    /// Whether a mask was given: without one, `hidden` is never read.
    #[cube(comptime)]
    pub masked: bool,
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

/// Whether query `query` of batch element `batch` sees key `key`: both within their
/// sequences, by position, and by the mask `hidden` `[batch or 1, s_q or 1, s_k]` when there is
/// one.
#[cube]
fn shows<M: Numeric>(
    hidden: &Tensor<M>,
    batch: usize,
    query: usize,
    key: usize,
    s_q: usize,
    s_k: usize,
    args: &AttentionArgs,
) -> bool {
    let mut visible = query < s_q && key < s_k;
    visible = visible && key >= first_key(query, args) && key < end_key(query, s_k, args);
    if args.masked.comptime() {
        // Read only in bounds: a row or key past the end is hidden already.
        if visible {
            let batch = select(hidden.shape(0) == 1, 0, batch);
            let row = select(hidden.shape(1) == 1, 0, query);
            visible = hidden
                [batch * hidden.stride(0) + row * hidden.stride(1) + key * hidden.stride(2)]
                == M::from_int(0);
        }
    }
    visible
}

/// Whether every query of `[q_first, q_first + queries)` sees every key of
/// `[k_first, k_first + keys)` by position, all within their sequences: a block that needs no
/// per-element check when there is no mask. The same in every unit of a cube.
#[allow(clippy::too_many_arguments)]
#[cube]
fn whole_block(
    q_first: usize,
    k_first: usize,
    s_q: usize,
    s_k: usize,
    args: &AttentionArgs,
    #[comptime] queries: usize,
    #[comptime] keys: usize,
) -> bool {
    let q_last = i32::cast_from(q_first + queries) - 1;
    let k_last = i32::cast_from(k_first + keys) - 1;
    let mut whole = q_first + queries <= s_q && k_first + keys <= s_k;
    if args.masked.comptime() {
        whole = false;
    }
    if args.causal.comptime() {
        whole = whole && k_last <= i32::cast_from(q_first) + args.offset;
    }
    if args.window > 0 {
        whole =
            whole && i32::cast_from(k_first) > q_last + args.offset - i32::cast_from(args.window);
    }
    whole
}

/// The rows a cube owns: cube `(x, y)` owns rows `x · block_rows ..` (of `len`) of the
/// `y`-th (batch, head) pair.
#[derive(CubeType, Clone, Copy)]
struct Block {
    /// `batch · heads + head`.
    pair: usize,
    batch: usize,
    head: usize,
    /// The block's first and last row.
    first: usize,
    last: usize,
}

#[cube]
fn block(heads: usize, len: usize, #[comptime] block_rows: usize) -> Block {
    let pair = CUBE_POS_Y as usize;
    let first = CUBE_POS_X as usize * block_rows;
    Block {
        pair,
        batch: pair / heads,
        head: pair % heads,
        first,
        last: min(first + block_rows, len) - 1,
    }
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
