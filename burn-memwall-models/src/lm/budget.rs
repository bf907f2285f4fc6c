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

use burn::tensor::DType;
use burn_memwall::memory::budget::{
    Budget, DeviceMemory, OptimizerPlan, ParameterCensus, Phase, Pool, Term, UpdateTiming,
};
use burn_memwall::ops::fused_linear_cross_entropy::FusedCrossEntropyOptions;

use super::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind, MlpKind};

use crate::Error;

/// Heap bytes of one op registered in Burn's autodiff graph on Flex: its node, boxed step and
/// state, and its entries in the server's and the memory manager's maps. Measured: the saved
/// tensors of the `tiny` baseline at seq 64, batch 2, are 10,674,692 B by the formulas above,
/// and the heap held 241 KB more over its 377 ops; the same figure then predicts every other
/// stack's `fwd saved` in memgate within 0.5% (tiny and small, seq 64 and 256).
pub const GRAPH_BYTES_PER_OP: u64 = 640;

/// Heap bytes a reversible chain's node holds per block besides tensors: its handles on the
/// block's modules, which share the model's parameters. Measured: the saved bytes of the
/// reversible `tiny` model less the formulas are 3,337 B per block (seq 32 and 128 alike), of
/// `small` 2,868 B. (Until the chain held evaluation copies of the blocks, 8.9 KB.)
pub const CHAIN_BYTES_PER_BLOCK: u64 = 3_100;

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

/// The sizes the formulas read, as `u64` element counts.
#[derive(Clone, Copy)]
struct Dims {
    batch: u64,
    seq: u64,
    /// `batch · seq`.
    tokens: u64,
    d: u64,
    heads: u64,
    d_kv: u64,
    d_ff: u64,
    vocab: u64,
    layers: u64,
    /// Bytes of one float.
    float: u64,
}

impl Dims {
    fn new(config: &LmConfig, shape: StepShape) -> Self {
        let (batch, seq) = (shape.batch as u64, shape.seq as u64);
        Self {
            batch,
            seq,
            tokens: batch * seq,
            d: config.d_model as u64,
            heads: config.n_heads as u64,
            d_kv: (config.n_kv_heads * config.d_head()) as u64,
            d_ff: config.d_ff as u64,
            vocab: config.vocab_size as u64,
            layers: config.n_layers as u64,
            float: shape.float.size() as u64,
        }
    }

    /// `[batch, heads, seq, seq]` float bytes: one attention score matrix per head.
    fn scores(&self) -> u64 {
        self.float * self.batch * self.heads * self.seq * self.seq
    }
}

/// Matrices of one MLP.
fn mlp_matrices(config: &LmConfig) -> u64 {
    match config.mlp {
        MlpKind::SwiGlu => 3,
        MlpKind::ReluSquared => 2,
    }
}

/// Activation-sized tensors one MLP saves (`c` in the formulas): SwiGLU `gate·x`, `σ(gate·x)`,
/// `silu`, `up·x` and the product; ReLU² `up·x`, its ReLU and the square.
fn mlp_saved_tensors(config: &LmConfig) -> u64 {
    match config.mlp {
        MlpKind::SwiGlu => 5,
        MlpKind::ReluSquared => 3,
    }
}

/// What one standard block saves for backward.
struct LayerSaved {
    bytes: u64,
    /// Ops it registers in the graph.
    ops: u64,
    formula: &'static str,
}

fn standard_layer(config: &LmConfig, shape: StepShape) -> LayerSaved {
    let dims = Dims::new(config, shape);
    let Dims {
        batch,
        seq,
        tokens,
        d,
        d_kv,
        d_ff,
        float,
        ..
    } = dims;
    let rows = batch * dims.heads * seq;
    // x and x + attention (the norms' inputs), the norms' x / rms and outputs, q and the output
    // projection's input.
    let common = 8 * tokens * d + mlp_saved_tensors(config) * tokens * d_ff + 4 * tokens;
    match config.attention {
        AttentionKind::Burn => LayerSaved {
            bytes: float * (common + 2 * tokens * d + rows)
                + 3 * dims.scores()
                + (4 + 2) * rows
                + seq * seq,
            formula: "4·(10·T·d + c·T·d_ff + 3·B·H·S² + B·H·S + 4·T) + 6·B·H·S + S²",
            // Norms 2 × 7, q and k 13 each, v 4, attention 12, output 4, MLP 9, residuals 2;
            // repeating grouped heads 3 each for k and v.
            ops: 71
                + if config.n_kv_heads < config.n_heads {
                    6
                } else {
                    0
                },
        },
        AttentionKind::Flash => LayerSaved {
            bytes: float * (common + 2 * tokens * d_kv + tokens * d + rows) + batch * seq,
            formula: "4·(9·T·d + 2·T·d_kv + c·T·d_ff + B·H·S + 4·T) + B·S",
            ops: 60,
        },
    }
}

/// The shape of a training step's batch and the float type of its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The float type of the weights, activations, gradients and optimizer state (the budget
    /// is measured in f32, the type the reference LM trains in today).
    pub float: DType,
}

impl StepShape {
    /// `batch` sequences of `seq` tokens in f32.
    pub fn f32(batch: usize, seq: usize) -> Self {
        Self {
            batch,
            seq,
            float: DType::F32,
        }
    }
}

/// What the forward pass of `config` keeps alive for the backward pass on a batch of `shape`,
/// with every parameter read through an in-backward hook when `routed`.
///
/// # Errors
/// [`Error::InvalidConfig`] for the linears whose saved tensors are not modelled yet
/// (ternary and counter).
pub fn saved_activations(
    config: &LmConfig,
    shape: StepShape,
    routed: bool,
) -> Result<Vec<Term>, Error> {
    require_dense_linears(config)?;
    let Dims {
        tokens,
        d,
        vocab,
        layers,
        float,
        ..
    } = Dims::new(config, shape);
    let block_params = 2 + 4 + mlp_matrices(config);
    let mut terms = Vec::new();
    let mut ops = 0;
    match config.blocks {
        BlockKind::Standard => {
            let layer = standard_layer(config, shape);
            terms.push(Term::new(
                Pool::SavedActivations,
                format!("{} layers, per layer: {}", config.n_layers, layer.formula),
                layers * layer.bytes,
            ));
            terms.push(Term::new(
                Pool::SavedActivations,
                "final norm: input, x / rms, 2 columns: 4·(2·T·d + 2·T)",
                float * (2 * tokens * d + 2 * tokens),
            ));
            ops += layers * layer.ops;
        }
        BlockKind::Reversible => {
            terms.push(Term::new(
                Pool::SavedActivations,
                "reversible chain output [T, 2d], stream mean, final norm: 4·(4·T·d + 2·T)",
                float * (4 * tokens * d + 2 * tokens),
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
                float * (tokens * d + tokens * vocab + tokens + 1 + tied_copy),
            ));
            ops += 22;
        }
        LossKind::Fused => {
            terms.push(Term::new(
                Pool::SavedActivations,
                "fused loss: d_hidden and d_weight, computed in forward: 4·(T·d + V·d + 1)",
                float * (tokens * d + vocab * d + 1),
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
pub fn parameter_census(config: &LmConfig, float: DType) -> Result<ParameterCensus, Error> {
    require_dense_linears(config)?;
    let float = float.size() as u64;
    let elements = config.param_count() as u64;
    let d = config.d_model as u64;
    // The largest matrix: the token table (and an untied head of the same shape), an MLP
    // matrix or a query/output projection (key/value projections are at most as wide).
    let largest = (config.vocab_size as u64 * d)
        .max(d * config.d_ff as u64)
        .max(d * d);
    Ok(ParameterCensus {
        bytes: float * elements,
        trained_elements: elements,
        trained_bytes: float * elements,
        largest_trained_bytes: float * largest,
    })
}

/// Elements of one 64×64 tile: flash attention's backward holds a few per query block.
const SCORE_TILE: u64 = 64 * 64;

/// The batches a linear's weight gradient is computed over before it is summed. Burn's
/// `linear` runs `[B, S, d_in] @ [1, d_in, d_out]`; its matmul keeps the batches (the weight
/// gradient is then `[B, d_in, d_out]`, summed after) unless the rows do not fill 32-row tiles
/// and merging the batches brings the output closer to square (burn-std's
/// `MatmulTransformPolicy::BetterTiling`).
fn weight_gradient_batches(batch: u64, seq: u64, d_out: u64) -> u64 {
    let rows = batch * seq;
    let squarer = rows.min(d_out) * seq.max(d_out) > seq.min(d_out) * rows.max(d_out);
    if batch == 1 || seq.is_multiple_of(32) || !squarer {
        batch
    } else {
        1
    }
}

/// The budget of one training step of `config` on a batch of `shape`, trained by `optimizer`,
/// on a device that holds tensors as `memory` does: the moments where the step can peak, each
/// with every term alive then (derived in docs/memory-model/peak-phases.md).
///
/// The phases, in the order they happen:
/// - **fused loss, forward** (fused loss): the worst chunk, its logits and weight-gradient share
///   beside everything the model saved;
/// - **loss backward** (Burn's loss): two `[T, vocab]` buffers beside the saved logits;
/// - **head backward** (Burn's loss): the head's weight gradient, made per batch and summed;
/// - **MLP backward** and **attention backward** (standard blocks), the worst block: the
///   activations of the blocks not walked yet, the gradients already made, the op's output;
/// - **MLP recompute** and **attention recompute** (reversible blocks), the worst block: the
///   sub-block rebuilt with its activations and its backward run;
/// - **embedding backward**: a zeroed `[vocab, d]` gradient beside every gradient kept;
/// - **optimizer step** (after backward): every gradient and the update's temporaries.
///
/// Left out, each small next to these here: the graph's bookkeeping while backward runs, the
/// matmul's own packing buffers, the in-backward hand-over maps.
///
/// # Errors
/// [`Error::InvalidConfig`] for the linears whose saved tensors are not modelled yet
/// (ternary and counter), and for a sequence longer than the model's context.
pub fn step_budget(
    config: &LmConfig,
    optimizer: &OptimizerPlan,
    shape: StepShape,
    memory: DeviceMemory,
) -> Result<Budget, Error> {
    if shape.seq > config.max_seq_len {
        return Err(Error::SequenceTooLong {
            seq_len: shape.seq,
            max_seq_len: config.max_seq_len,
        });
    }
    let census = parameter_census(config, shape.float)?;
    let after = optimizer.timing == UpdateTiming::AfterBackward;
    let saved = saved_activations(config, shape, !after)?;
    let dims = Dims::new(config, shape);
    let Dims {
        batch,
        seq,
        tokens,
        d,
        d_kv,
        d_ff,
        vocab,
        layers,
        float,
        ..
    } = dims;
    let copies = memory.output_copies();
    let graph = |ops: u64| match memory.holds_the_graph() {
        true => ops * GRAPH_BYTES_PER_OP,
        false => 0,
    };
    // Bytes of the step's tensor shapes.
    let [td, tf, tv, vd, fd, dd, td_kv] = [
        tokens * d,
        tokens * d_ff,
        tokens * vocab,
        vocab * d,
        d_ff * d,
        d * d,
        tokens * d_kv,
    ]
    .map(|elements| float * elements);
    let mlp_params = float * mlp_matrices(config) * d * d_ff;
    let layer_params = mlp_params + float * (2 * d + 2 * d * d + 2 * d * d_kv);
    let mlp_saved = mlp_saved_tensors(config);
    let tied = config.tie_embeddings;

    let rope_tables = match config.blocks {
        BlockKind::Standard => 1,
        // The model's and the chain's.
        BlockKind::Reversible => 2,
    };
    let persistent = [
        Term::new(Pool::Parameters, "parameters", census.bytes),
        Term::new(
            Pool::Parameters,
            format!("rotary table(s): {rope_tables} × 2·max_seq·d_head floats"),
            rope_tables * float * 2 * (config.max_seq_len * config.d_head()) as u64,
        ),
        optimizer.state(&census),
    ];
    let phase = |name: &'static str, terms: Vec<Term>| Phase {
        name,
        terms: persistent.iter().cloned().chain(terms).collect(),
    };
    let workspace = |what: String, bytes: u64| Term::new(Pool::Workspace, what, bytes);
    // The gradients alive when backward reaches block `l`: the head's and final norm's, and
    // every later block's (after backward); in backward only the tied table's head share,
    // which waits for the embedding's.
    let gradients_at = |l: u64| match (after, tied) {
        (true, _) => Term::new(
            Pool::Gradients,
            format!("head, final norm and {} later block(s)", layers - 1 - l),
            vd + float * d + (layers - 1 - l) * layer_params,
        ),
        (false, true) => Term::new(
            Pool::Gradients,
            "the tied table's head share, until the embedding's backward",
            vd,
        ),
        (false, false) => Term::new(Pool::Gradients, "none: each applied when made", 0),
    };
    // The worst of `phase_at(l)` over the blocks.
    let worst_block = |phase_at: &dyn Fn(u64) -> Phase| {
        (0..layers)
            .map(phase_at)
            .max_by_key(Phase::bytes)
            .expect("a model has at least one block")
    };

    let mut phases = Vec::new();
    match config.loss {
        LossKind::Fused => {
            let chunk = (FusedCrossEntropyOptions::default().chunk_tokens(vocab as usize) as u64)
                .min(tokens);
            let (cd, cv) = (float * chunk * d, float * chunk * vocab);
            // The first chunk writes the weight gradient's running sum; later ones add to it.
            let first_only = if chunk == tokens { vd } else { 0 };
            let mut terms = saved.clone();
            terms.push(workspace(
                format!("hidden states, a {chunk}-token chunk's rows, its logits and weight-gradient share"),
                td + cd + (cv + copies * vd).max(copies * cv) - first_only,
            ));
            phases.push(phase("fused loss, forward", terms));
        }
        LossKind::Burn => {
            let mut terms = saved.clone();
            terms.push(workspace(
                "two [T, vocab] buffers (gather's zeros, the log-softmax gradient)".into(),
                2 * tv,
            ));
            phases.push(phase("loss backward", terms));
            let weight_gradient = match tied {
                // A batched matmul by the table's transposed copy, which is freed first.
                true => copies * batch * vd - vd,
                false => copies * weight_gradient_batches(batch, seq, vocab) * vd,
            };
            let mut terms = saved.clone();
            terms.push(workspace(
                "hidden-state gradient, the head's weight gradient made per batch".into(),
                td + weight_gradient,
            ));
            phases.push(phase("head backward", terms));
        }
    }
    let down_gradient = copies * weight_gradient_batches(batch, seq, d) * fd;
    match config.blocks {
        BlockKind::Standard => {
            let layer = standard_layer(config, shape);
            // What blocks 0..=l still hold when backward reaches block l.
            let saved_to = |l: u64| {
                vec![
                    Term::new(
                        Pool::SavedActivations,
                        format!("blocks 0..={l}"),
                        (l + 1) * layer.bytes,
                    ),
                    Term::new(
                        Pool::Backend,
                        "their autodiff graph",
                        graph((l + 1) * layer.ops),
                    ),
                ]
            };
            phases.push(worst_block(&|l| {
                let mut terms = saved_to(l);
                terms.push(gradients_at(l));
                terms.push(workspace(
                    format!(
                        "block {l}: output gradient, MLP-input gradient, down-projection weight \
                         gradient made per batch"
                    ),
                    td + tf + ((copies - 1) * tf).max(down_gradient),
                ));
                phase("MLP backward", terms)
            }));
            phases.push(worst_block(&|l| {
                let mut terms = saved_to(l);
                // Block l's MLP has given back its activations, its norm's and its input.
                terms[0] = Term::new(
                    Pool::SavedActivations,
                    format!("blocks 0..{l}, and block {l}'s attention part"),
                    (l + 1) * layer.bytes
                        - float * (mlp_saved * tokens * d_ff + 4 * tokens * d + 2 * tokens),
                );
                terms.push(gradients_at(l));
                if after {
                    terms.push(Term::new(
                        Pool::Gradients,
                        format!("block {l}'s MLP and output projection"),
                        mlp_params + dd,
                    ));
                }
                let op = match config.attention {
                    AttentionKind::Burn => copies * dims.scores(),
                    AttentionKind::Flash => td + 3 * td_kv + 4 * float * SCORE_TILE,
                };
                terms.push(workspace(
                    format!(
                        "block {l}: two activation gradients and the attention backward's buffers"
                    ),
                    2 * td + op,
                ));
                phase("attention backward", terms)
            }));
        }
        BlockKind::Reversible => {
            // The loss, the final norm and the chain's output are consumed by now; the chain's
            // handles, in-backward uses and graph remain.
            let chain: Vec<Term> = saved
                .iter()
                .filter(|term| term.pool == Pool::Backend)
                .cloned()
                .collect();
            phases.push(worst_block(&|b| {
                let mut terms = chain.clone();
                terms.push(gradients_at(b));
                terms.push(workspace(
                    format!(
                        "block {b}: the walk's y, dy; the MLP rebuilt (norm, output and its \
                         gradient, c + 1 [T, d_ff]); the down-projection weight gradient"
                    ),
                    float * 8 * tokens * d
                        + (mlp_saved + 1) * tf
                        + ((copies - 1) * tf).max(down_gradient)
                        + float * 2 * tokens,
                ));
                phase("MLP recompute", terms)
            }));
            phases.push(worst_block(&|b| {
                let mut terms = chain.clone();
                terms.push(gradients_at(b));
                if after {
                    terms.push(Term::new(
                        Pool::Gradients,
                        format!("block {b}'s MLP"),
                        mlp_params,
                    ));
                }
                let rows = batch * dims.heads * seq;
                let attention = match config.attention {
                    AttentionKind::Burn => {
                        float * 13 * tokens * d
                            + (3 + copies) * dims.scores()
                            + 12 * rows
                            + seq * seq
                    }
                    AttentionKind::Flash => {
                        float * 13 * tokens * d + 5 * td_kv + 4 * float * SCORE_TILE
                    }
                };
                terms.push(workspace(
                    format!(
                        "block {b}: the walk's state, the attention rebuilt and its backward, \
                         the output projection's gradient"
                    ),
                    attention + dd,
                ));
                phase("attention recompute", terms)
            }));
        }
    }
    let kept = match (after, tied) {
        // The head's share holds the tied table's gradient, which the embedding's adds to.
        (true, true) => census.trained_bytes,
        (true, false) => census.trained_bytes - vd,
        (false, true) => vd,
        (false, false) => 0,
    };
    phases.push(phase(
        "embedding backward",
        vec![
            Term::new(Pool::Gradients, "every gradient kept so far", kept),
            workspace(
                "the embedding's output gradient and its zeroed [vocab, d] gradient".into(),
                td + copies * vd,
            ),
        ],
    ));
    if after {
        phases.push(phase(
            "optimizer step",
            vec![
                optimizer.gradients(&census),
                optimizer.update_temporaries(&census),
            ],
        ));
    }
    Ok(Budget { phases })
}
