//! What the reference LM's forward pass keeps for its backward pass, op by op, as formulas.
//!
//! Burn 0.22.1's autodiff (no checkpointing, the default) keeps, for each tracked op, the
//! inputs its backward reads; a tensor kept by several ops is one buffer. Walking the LM's
//! forward (`T = batch · seq` tokens, `d_kv = n_kv_heads · d_head`, f32):
//! - each RMSNorm keeps its input, `x / rms` (`T·d` each) and two `[T, 1]` columns; its
//!   output is kept by the linears that read it;
//! - each linear keeps its input (the weight is a parameter, alive anyway);
//! - the rotary embedding keeps nothing of activation size (its table is a buffer);
//! - Burn's attention keeps q, and k and v repeated to every query head, the concatenated
//!   heads that the output projection reads, and three `[batch, heads, seq, seq]` tensors
//!   (`s − max`, `exp(s − max)` and the probabilities), one `[…, 1]` column each of f32 sums,
//!   i32 arg-max indices and two bool masks, and the `[seq, seq]` bool causal mask;
//! - flash attention keeps q, k and v at their own head counts, its output and one log-sum-exp
//!   per row (and a `[batch, seq]` bool padding mask); the output projection's input is a
//!   second copy of the output (a reshape of a transposed view copies);
//! - SwiGLU keeps `gate·x`, `σ(gate·x)`, `silu`, `up·x` and the product (`5·T·d_ff`); ReLU²
//!   keeps `up·x`, its ReLU and the square (`3·T·d_ff`);
//! - Burn's loss keeps the final hidden states, one `[T, vocab]` tensor (`logits − max`) and a
//!   `[T]` column; a head tied to the embedding is read through a transposed copy of the table
//!   (`vocab·d`), which the head's matmul keeps;
//! - the fused loss (gradients during forward) keeps `d_hidden` (`T·d`) and `d_weight`
//!   (`vocab·d`) and lets the hidden states go;
//! - reversible blocks run outside autodiff: the chain keeps its `[T, 2d]` output, and the
//!   mean of the two streams (`T·d`) is the final norm's input.
//!
//! Flex's heap also holds the graph itself: [`GRAPH_BYTES_PER_OP`] per registered op, and
//! [`CHAIN_BYTES_PER_BLOCK`] per reversible block. Both are measured, and Cube devices keep
//! them in host memory, outside the device's pools.

use burn_memwall::memory::budget::{ParameterCensus, Pool, Term};

use super::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind, MlpKind};
use crate::Error;

/// Bytes of an f32.
const FLOAT: u64 = 4;

/// Heap bytes of one op registered in Burn's autodiff graph on Flex: its node, boxed step and
/// state, and its entries in the server's and the memory manager's maps. Measured: the saved
/// tensors of the `tiny` baseline at seq 64, batch 2, are 10,674,692 B by the formulas above,
/// and the heap held 241 KB more over its 377 ops; the same figure then predicts every other
/// stack's `fwd saved` in memgate within 0.5% (tiny and small, seq 64 and 256).
pub const GRAPH_BYTES_PER_OP: u64 = 640;

/// Heap bytes a reversible chain's node holds per block besides tensors (detached handles of
/// the block's modules and parameters), measured in docs/BENCHMARKS.md (415 → 477 KB from 1 to
/// 8 blocks).
pub const CHAIN_BYTES_PER_BLOCK: u64 = 8_900;

/// Heap bytes a routed reversible chain holds per trained parameter of its blocks: the
/// parameter's handle and its entries in the chain's and the [`InBackward`]'s use maps, for its
/// update in backward. Measured: routing the `tiny` reversible model through `InBackward` adds
/// 63,168 B at seq 32 and at seq 128 alike; less its 3 graph hooks (embedding, final norm,
/// head), that is 1,361 B for each of its 45 block parameters.
///
/// [`InBackward`]: burn_memwall::optim::InBackward
pub const ROUTED_USE_BYTES: u64 = 1_360;

/// The budget's formulas know dense linears only: the quantised ones' codes and saved tensors
/// are not modelled yet, and are refused rather than mispredicted.
fn require_dense_linears(config: &LmConfig) -> Result<(), Error> {
    if config.linear == LinearKind::Dense {
        return Ok(());
    }
    Err(Error::InvalidConfig(format!(
        "the memory budget models dense linears only, not {:?}",
        config.linear
    )))
}

/// A training batch's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

/// What the forward pass of `config` keeps alive for the backward pass on a batch of `shape`,
/// with every parameter read through an in-backward hook when `routed`.
///
/// # Errors
/// [`Error::InvalidConfig`] for the linears whose saved tensors are not modelled yet
/// (ternary and counter).
pub fn saved_activations(
    config: &LmConfig,
    shape: BatchShape,
    routed: bool,
) -> Result<Vec<Term>, Error> {
    require_dense_linears(config)?;
    let (batch, seq) = (shape.batch as u64, shape.seq as u64);
    let tokens = batch * seq;
    let d = config.d_model as u64;
    let (heads, kv_heads) = (config.n_heads as u64, config.n_kv_heads as u64);
    let d_kv = kv_heads * config.d_head() as u64;
    let d_ff = config.d_ff as u64;
    let vocab = config.vocab_size as u64;
    let layers = config.n_layers as u64;
    let rows = batch * heads * seq;

    let (mlp_tensors, mlp_matrices) = match config.mlp {
        MlpKind::SwiGlu => (5, 3),
        MlpKind::ReluSquared => (3, 2),
    };
    // Two norms, four attention projections and the MLP's matrices.
    let block_params = 2 + 4 + mlp_matrices;
    let mut terms = Vec::new();
    let mut ops = 0;
    match config.blocks {
        BlockKind::Standard => {
            // x and x + attention (the norms' inputs), the norms' x / rms and outputs, q and
            // the output projection's input.
            let common = 8 * tokens * d + mlp_tensors * tokens * d_ff + 4 * tokens;
            let (layer, what, layer_ops) = match config.attention {
                AttentionKind::Burn => (
                    FLOAT * (common + 2 * tokens * d + 3 * rows * seq + rows)
                        + (4 + 2) * rows
                        + seq * seq,
                    "per layer: 4·(10·T·d + c·T·d_ff + 3·B·H·S² + B·H·S + 4·T) + 6·B·H·S + S²",
                    // Norms 2 × 7, q and k 13 each, v 4, attention 12, output 4, MLP 9,
                    // residuals 2; repeating grouped heads 3 each for k and v.
                    71 + if kv_heads < heads { 6 } else { 0 },
                ),
                AttentionKind::Flash => (
                    FLOAT * (common + 2 * tokens * d_kv + tokens * d + rows) + batch * seq,
                    "per layer: 4·(9·T·d + 2·T·d_kv + c·T·d_ff + B·H·S + 4·T) + B·S",
                    60,
                ),
            };
            terms.push(Term::new(
                Pool::SavedActivations,
                format!("{} layers, {what}", config.n_layers),
                layers * layer,
            ));
            terms.push(Term::new(
                Pool::SavedActivations,
                "final norm: input, x / rms, 2 columns: 4·(2·T·d + 2·T)",
                FLOAT * (2 * tokens * d + 2 * tokens),
            ));
            ops += layers * layer_ops;
        }
        BlockKind::Reversible => {
            terms.push(Term::new(
                Pool::SavedActivations,
                "reversible chain output [T, 2d], stream mean, final norm: 4·(4·T·d + 2·T)",
                FLOAT * (4 * tokens * d + 2 * tokens),
            ));
            terms.push(Term::new(
                Pool::Backend,
                format!("reversible chain: {CHAIN_BYTES_PER_BLOCK} B per block"),
                layers * CHAIN_BYTES_PER_BLOCK,
            ));
            // The embedding's copy into two streams, the chain and the stream mean.
            ops += 6;
        }
    }
    match config.loss {
        LossKind::Burn => {
            let tied_copy = if config.tie_embeddings { vocab * d } else { 0 };
            terms.push(Term::new(
                Pool::SavedActivations,
                "Burn's loss: hidden, logits − max, a column (+ the tied head's transposed \
                 copy): 4·(T·d + T·V + T + 1) + 4·V·d if tied",
                FLOAT * (tokens * d + tokens * vocab + tokens + 1 + tied_copy),
            ));
            ops += 22;
        }
        LossKind::Fused => {
            terms.push(Term::new(
                Pool::SavedActivations,
                "fused loss: d_hidden and d_weight, computed in forward: 4·(T·d + V·d + 1)",
                FLOAT * (tokens * d + vocab * d + 1),
            ));
            ops += 10;
        }
    }
    if routed {
        // One graph hook per parameter read outside the blocks: the embedding, the final norm
        // and the head.
        ops += 3;
        match config.blocks {
            // And one per parameter read inside each standard block.
            BlockKind::Standard => ops += block_params * layers,
            // A reversible chain runs its blocks outside the graph and holds their uses itself.
            BlockKind::Reversible => terms.push(Term::new(
                Pool::Backend,
                format!(
                    "in-backward uses held by the chain: {block_params} per block × \
                     {ROUTED_USE_BYTES} B"
                ),
                block_params * layers * ROUTED_USE_BYTES,
            )),
        }
    }
    terms.push(Term::new(
        Pool::Backend,
        format!("autodiff graph on Flex: {ops} ops × {GRAPH_BYTES_PER_OP} B"),
        ops * GRAPH_BYTES_PER_OP,
    ));
    Ok(terms)
}

/// The parameters `config` builds, counted from its shapes without building it: what
/// [`ParameterCensus::of`] reads from the model (so a 70B config costs nothing to count).
///
/// # Errors
/// [`Error::InvalidConfig`] for the quantised linears, whose codes are not modelled yet.
pub fn parameter_census(config: &LmConfig) -> Result<ParameterCensus, Error> {
    require_dense_linears(config)?;
    let elements = config.param_count() as u64;
    let d = config.d_model as u64;
    // The largest matrix: the token table (and an untied head of the same shape), an MLP
    // matrix or a query/output projection (key/value projections are at most as wide).
    let largest = (config.vocab_size as u64 * d)
        .max(d * config.d_ff as u64)
        .max(d * d);
    Ok(ParameterCensus {
        bytes: FLOAT * elements,
        trained_elements: elements,
        trained_bytes: FLOAT * elements,
        largest_trained_bytes: FLOAT * largest,
    })
}
