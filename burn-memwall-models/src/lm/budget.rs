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
//! them in host memory, outside the device's pools. Cube devices also store a bool in 4 bytes
//! and read the tied head's transposed table without copying it.
//!
//! Every term lists its tensors, in the order the step makes them: a paged device
//! ([`DeviceMemory::Pools`]) places them one by one.

use burn::tensor::DType;
use burn_memwall::codes::counter::words_per_row;
use burn_memwall::memory::budget::{
    Budget, DeviceMemory, OptimizerPlan, ParameterCensus, Phase, Placement, Pool, Tensors, Term,
    UpdateTiming, persistent_slots, read_back_pages,
};
use burn_memwall::nn::counter_loss_block_rows;
use burn_memwall::ops::fused_linear_cross_entropy::FusedCrossEntropyOptions;
use burn_memwall::ops::packed_matmul::block_rows;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::optim::InactiveState;

use super::config::BlockWeight;
use super::{AttentionKind, BlockKind, LinearKind, LmConfig, LossKind, MlpKind, SaverKind};

use crate::Error;

/// Heap bytes of one op registered in Burn's autodiff graph on Flex: its node, boxed step and
/// state, and its entries in the server's and the memory manager's maps. Measured: the saved
/// tensors of the `tiny` baseline at seq 64, batch 2, are 10,674,692 B by the formulas above,
/// and the heap held 241 KB more over its 377 ops; the same figure then predicts every other
/// stack's `fwd saved` in memgate within 0.5% (tiny and small, seq 64 and 256).
pub const GRAPH_BYTES_PER_OP: u64 = 640;

/// Graph ops Burn's autodiff registers for one composed RMSNorm (`lm::budget`'s formulas).
const BURN_NORM_OPS: u64 = 7;

/// The graph ops' worth a block registers fewer when q and k take the one-pass rotary op
/// (`ops::rotary`) in place of Burn's `RotaryEncoding::apply`, which registers about 11 ops a
/// call (6.6–7.2 KB measured alone, at any batch and length). Measured in the LM (tiny, seq 32
/// and 128 alike, so bookkeeping, no activation): 11.3 KB a layer fewer with Burn's attention,
/// 16.8 KB with flash attention, whose node and the views before it register differently with
/// the heads split after the rotation than before it.
fn fewer_rotary_ops(attention: AttentionKind) -> u64 {
    match attention {
        AttentionKind::Burn => 18,
        AttentionKind::Flash => 26,
    }
}

/// A handwritten node's bookkeeping (the saving norm's and MLP activation's), in ops of
/// [`GRAPH_BYTES_PER_OP`]: besides the node, its state boxes the backward and maps the other
/// gradients' nodes. Measured: with 3 the `tiny` saved bytes are predicted within 0.7% for both
/// MLPs (`tests/budget.rs`).
const HANDWRITTEN_NODE_OPS: u64 = 3;

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

/// Heap bytes a counter-coded matrix holds besides its tensors: its shared state's
/// `Arc<Mutex>` and the handles on it. Fitted, 1.2–1.7 KB over three models
/// (docs/memory-model/counter-linears.md).
pub const CODED_MATRIX_BYTES: u64 = 1_500;

/// How the model's matrices are stored, where they are not dense f32 weights:
/// - counter codes (`burn_memwall::nn::CounterLinear`) hold 0.75 B per weight and 8 B per row,
///   take no gradient and no optimizer state, and update themselves in backward
///   (docs/memory-model/counter-linears.md);
/// - ternary linears (`burn_memwall::nn::TernaryLinear`) hold and train f32 latent weights as
///   a dense linear does, keep nothing more between steps, and recompute the ternary weight
///   in forward and backward.
#[derive(Clone, Copy)]
struct Coding {
    /// The blocks' linears are counter codes.
    blocks: bool,
    /// The blocks' linears are ternary.
    ternary: bool,
    /// The token table, and the head when it is not tied, are counter codes.
    table: bool,
}

impl Coding {
    fn of(config: &LmConfig) -> Self {
        let (blocks, ternary, table) = match config.linear {
            LinearKind::Dense => (false, false, false),
            LinearKind::Ternary => (false, true, false),
            LinearKind::Counter => (true, false, false),
            LinearKind::CounterAll => (true, false, true),
        };
        Self {
            blocks,
            ternary,
            table,
        }
    }

    /// The coding of `config`, whose step's memory the budget models on `memory`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for half precision and LoRA on pools (measured on Flex only);
    /// for counter codes, ternary linears and low-bit saved activations in half precision or
    /// with LoRA (measured in f32 without LoRA only); and for a coded head read by Burn's
    /// loss, which no stack uses.
    fn modelled(config: &LmConfig, shape: StepShape, memory: DeviceMemory) -> Result<Self, Error> {
        let coding = Self::of(config);
        let (half, lora) = (shape.float.size() == 2, shape.lora_rank.is_some());
        if (half || lora) && memory != DeviceMemory::Heap {
            return Err(Error::InvalidConfig(
                "the memory budget models half precision and LoRA on Flex only, not on Cube \
                 devices' pools"
                    .into(),
            ));
        }
        if (coding.blocks || coding.ternary) && (half || lora) {
            return Err(Error::InvalidConfig(
                "the memory budget models counter and ternary linears in f32 without LoRA only"
                    .into(),
            ));
        }
        if config.saved_precision != SavedPrecision::Full && (half || lora) {
            return Err(Error::InvalidConfig(
                "the memory budget models low-bit saved activations in f32 without LoRA only"
                    .into(),
            ));
        }
        if coding.table && config.loss == LossKind::Burn {
            return Err(Error::InvalidConfig(
                "the memory budget models a counter head with the fused loss only".into(),
            ));
        }
        Ok(coding)
    }

    /// The block weights that train: the norms only when the linears are coded.
    fn trained_block_weights(self, config: &LmConfig) -> impl Iterator<Item = BlockWeight> {
        config
            .block_weights()
            .into_iter()
            .filter(move |weight| !self.blocks || matches!(weight, BlockWeight::Norm(_)))
    }

    /// The coded matrices' shapes, `[d_out, d_in]`, in the order the model makes them: the
    /// token table, each block's, an untied head.
    fn matrices(self, config: &LmConfig) -> Vec<[usize; 2]> {
        let table = [config.vocab_size, config.d_model];
        let block = config
            .block_weights()
            .into_iter()
            .filter_map(|weight| match weight {
                BlockWeight::Matrix { d_out, d_in } => Some([d_out, d_in]),
                BlockWeight::Norm(_) => None,
            });
        let blocks: Vec<[usize; 2]> = block.collect();
        let head = self.table && !config.tie_embeddings;
        (self.table.then_some(table).into_iter())
            .chain(
                (0..config.n_layers)
                    .filter(|_| self.blocks)
                    .flat_map(|_| blocks.clone()),
            )
            .chain(head.then_some(table))
            .collect()
    }
}

/// A `[d_out, d_in]` counter code's tensors on the device: its words, and each row's scale
/// and mean squared gradient (f32).
fn code_tensors(d_out: usize, d_in: usize) -> [Tensors; 2] {
    [
        Tensors::new(1, (4 * words_per_row(d_in) * d_out) as u64),
        Tensors::new(2, 4 * d_out as u64),
    ]
}

/// `count` activations `[rows, width]` kept in `precision`'s low-bit codes: two tensors
/// each, the codes and the row scales (`SavedPrecision::code_and_scale_bytes`).
fn coded(count: u64, precision: SavedPrecision, rows: u64, width: u64) -> Vec<Tensors> {
    precision
        .code_and_scale_bytes(rows as usize, width as usize)
        .expect("codes of a low-bit precision")
        .map(|bytes| Tensors::new(count, bytes as u64))
        .to_vec()
}

/// Bytes of a `[d_out, d_in]` counter code: its tensors, and its step (an int, on the host).
fn coded_bytes(d_out: usize, d_in: usize) -> u64 {
    code_tensors(d_out, d_in)
        .iter()
        .map(|tensors| tensors.total_bytes())
        .sum::<u64>()
        + 4
}

/// The sizes the formulas read, as `u64` element counts, and the bytes of the step's tensors.
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
    /// The floats are half precision: each RMSNorm takes its mean square in f32.
    half: bool,
    /// The rank of the blocks' LoRA adapters, when only they train.
    lora_rank: Option<u64>,
    /// Whether the layers' own weights train (not with LoRA: its adapters do).
    layers_train: bool,
    /// Whether the token table, the final norm and the head train.
    table_and_head_train: bool,
    /// What the norms and the MLP's activation keep.
    savers: SaverKind,
    /// A saving SwiGLU and the dense down projection are one node that recomputes the product
    /// in backward (`swiglu_linear`), rather than the down projection keeping it.
    recomputes_product: bool,
    /// How the MLP node keeps its activations (`LmConfig::mlp_precision`).
    precision: SavedPrecision,
    /// The MLP's activation and its dense down projection are one node that keeps its inputs
    /// in low bits (`swiglu_linear`, `relu_squared_linear`).
    mlp_codes: bool,
    /// How flash attention keeps its values (`flash_attention_saving_values`): in codes
    /// unless `Full`.
    values: SavedPrecision,
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
            half: shape.float.size() == 2,
            lora_rank: shape.lora_rank.map(|rank| rank as u64),
            layers_train: shape.lora_rank.is_none()
                && shape.trained != TrainedWeights::TableAndHead,
            table_and_head_train: shape.lora_rank.is_none()
                && shape.trained != TrainedWeights::Layers,
            savers: config.savers,
            recomputes_product: config.savers == SaverKind::Exact
                && config.mlp == MlpKind::SwiGlu
                && config.linear == LinearKind::Dense
                && shape.lora_rank.is_none(),
            precision: config.mlp_precision(),
            mlp_codes: config.saved_precision != SavedPrecision::Full
                && config.savers == SaverKind::Exact
                && config.linear == LinearKind::Dense
                && shape.lora_rank.is_none(),
            values: match config.attention {
                AttentionKind::Flash => config.values_precision(),
                AttentionKind::Burn => SavedPrecision::Full,
            },
        }
    }

    /// What one RMSNorm keeps besides its output (which the ops reading it keep). Burn's: its
    /// input, `x / rms` for its scale's gradient (when `scale_trains`), an f32 copy of the input
    /// in half precision (the mean square is taken in f32; in f32 the cast is the input
    /// itself), and two `[T]` columns. The saving norm: one f32 per row (its backward reads
    /// `x / rms` back from its output).
    fn norm_saved(&self, scale_trains: bool) -> Vec<Tensors> {
        match self.savers {
            SaverKind::Burn => vec![
                self.td(1 + u64::from(scale_trains)),
                Tensors::new(u64::from(self.half), 4 * self.tokens * self.d),
                self.columns(2),
            ],
            SaverKind::Exact => vec![Tensors::new(1, 4 * self.tokens)],
        }
    }

    /// What the final norm keeps: what a block's norm keeps, and the saving norm its output
    /// too where the loss does not keep it (the fused loss makes its gradients in forward).
    fn final_norm_saved(&self, loss_keeps_hidden: bool) -> Vec<Tensors> {
        let output = self.savers == SaverKind::Exact && !loss_keeps_hidden;
        let mut saved = self.norm_saved(self.table_and_head_train);
        saved.push(self.td(u64::from(output)));
        saved
    }

    /// Activation-sized tensors one MLP keeps (`c` in the formulas). Burn's: SwiGLU `gate·x`,
    /// `σ(gate·x)`, `silu`, `up·x` and the product; ReLU² `up·x`, its ReLU and the square. The
    /// saving ops: SwiGLU `gate·x`, `up·x` and the product (not the product where the down
    /// projection recomputes it), ReLU² the square; in low bits, the node's codes of SwiGLU's
    /// two inputs or of ReLU²'s `relu(u)`.
    fn mlp_saved(&self, mlp: MlpKind) -> Vec<Tensors> {
        if self.mlp_codes {
            let count = match mlp {
                MlpKind::SwiGlu => 2,
                MlpKind::ReluSquared => 1,
            };
            return coded(count, self.precision, self.tokens, self.d_ff);
        }
        let count = match (self.savers, mlp) {
            (SaverKind::Burn, MlpKind::SwiGlu) => 5,
            (SaverKind::Burn, MlpKind::ReluSquared) => 3,
            (SaverKind::Exact, MlpKind::SwiGlu) => 3 - u64::from(self.recomputes_product),
            (SaverKind::Exact, MlpKind::ReluSquared) => 1,
        };
        vec![self.tf(count)]
    }

    /// The graph ops' worth of bookkeeping a norm registers fewer with the saving op: one
    /// handwritten node for Burn's seven ops.
    fn fewer_norm_ops(&self) -> u64 {
        match self.savers {
            SaverKind::Burn => 0,
            SaverKind::Exact => BURN_NORM_OPS - HANDWRITTEN_NODE_OPS,
        }
    }

    /// The graph ops' worth a block registers fewer with the saving ops: its two norms', one
    /// handwritten node for Burn's SwiGLU (`σ`, two products, and the down projection's
    /// product where the node makes it) or ReLU² (ReLU, square), and the one-pass rotary's.
    fn fewer_block_ops(&self, mlp: MlpKind, attention: AttentionKind) -> u64 {
        let activation = match mlp {
            MlpKind::SwiGlu => 3 + u64::from(self.recomputes_product),
            MlpKind::ReluSquared => 2 + u64::from(self.mlp_codes),
        };
        match self.savers {
            SaverKind::Burn => 0,
            SaverKind::Exact => {
                2 * self.fewer_norm_ops() + activation - HANDWRITTEN_NODE_OPS
                    + fewer_rotary_ops(attention)
            }
        }
    }

    /// What a saving MLP activation's backward holds beyond the block's saved tensors, less the
    /// down projection's input it gives back: SwiGLU the input gradient and the two it makes in
    /// one pass (the up projection's and the gate's); ReLU² the input gradient and its own.
    /// Burn's are within the down projection's backward (none listed).
    fn activation_backward(&self, mlp: MlpKind) -> Vec<Tensors> {
        match (self.savers, mlp) {
            (SaverKind::Burn, _) => Vec::new(),
            (SaverKind::Exact, MlpKind::SwiGlu) => vec![self.tf(2)],
            (SaverKind::Exact, MlpKind::ReluSquared) => vec![self.tf(2)],
        }
    }

    /// What the formulas written for f32 and every weight trained read differently here.
    fn formula_note(&self) -> String {
        let mut note = String::new();
        if self.half {
            note += "; floats of 2 bytes, and each norm's input in f32 (+4·T·d)";
        }
        if self.lora_rank.is_some() {
            note += "; LoRA: frozen norms keep no x / rms, + T·r per adapted linear";
        }
        if self.savers == SaverKind::Exact {
            let swiglu = match self.recomputes_product {
                true => 2,
                false => 3,
            };
            note += &format!(
                "; saving ops: each norm keeps 4·T (not x), c = {swiglu} (SwiGLU) or 1 (ReLU²)"
            );
        }
        if self.mlp_codes || self.values != SavedPrecision::Full {
            note += &format!(
                "; in codes (bits/8 per value, 4 B per row): the MLP node's c tensors ({:?}), \
                 flash attention's v ({:?})",
                self.precision, self.values
            );
        }
        note
    }

    /// `count` `[T, rank]` tensors: what `count` LoRA-adapted linears keep besides their input
    /// (`x·A`, for `B`'s gradient); none without LoRA.
    fn adapter_products(&self, count: u64) -> Tensors {
        match self.lora_rank {
            Some(rank) => self.floats(count, self.tokens * rank),
            None => Tensors::new(0, 0),
        }
    }

    /// `count` float tensors of `elements` each.
    fn floats(&self, count: u64, elements: u64) -> Tensors {
        Tensors::new(count, self.float * elements)
    }

    /// `count` `[T, d]` tensors.
    fn td(&self, count: u64) -> Tensors {
        self.floats(count, self.tokens * self.d)
    }

    /// `count` `[T, d_ff]` tensors.
    fn tf(&self, count: u64) -> Tensors {
        self.floats(count, self.tokens * self.d_ff)
    }

    /// `count` `[T, d_kv]` tensors.
    fn td_kv(&self, count: u64) -> Tensors {
        self.floats(count, self.tokens * self.d_kv)
    }

    /// What flash attention keeps of k and v: both in full, or v in codes (rows of `d_head`).
    fn keys_and_values(&self) -> Vec<Tensors> {
        match self.values {
            SavedPrecision::Full => vec![self.td_kv(2)],
            precision => {
                let d_head = self.d / self.heads;
                let rows = self.tokens * self.d_kv / d_head;
                let mut kept = vec![self.td_kv(1)];
                kept.extend(coded(1, precision, rows, d_head));
                kept
            }
        }
    }

    /// `count` `[vocab, d]` tensors: the token table's size.
    fn vd(&self, count: u64) -> Tensors {
        self.floats(count, self.vocab * self.d)
    }

    /// `count` `[T]` columns.
    fn columns(&self, count: u64) -> Tensors {
        self.floats(count, self.tokens)
    }

    /// `count` `[batch, heads, seq]` tensors of `bytes` per element: one per attention row.
    fn rows(&self, count: u64, bytes: u64) -> Tensors {
        Tensors::new(count, bytes * self.batch * self.heads * self.seq)
    }

    /// `count` `[batch, heads, seq, seq]` float tensors: one attention score matrix per head.
    fn scores(&self, count: u64) -> Tensors {
        self.floats(count, self.batch * self.heads * self.seq * self.seq)
    }
}

/// What one standard block saves for backward.
struct LayerSaved {
    /// What the attention's backward reads: its norm's input, `x / rms` and output, q, k, v
    /// and the attention's own.
    attention: Vec<Tensors>,
    /// What the output projection and the MLP half keep, given back before the attention's
    /// backward runs: the projection's input, the MLP norm's input, `x / rms`, output and
    /// columns, the MLP's own.
    after_attention: Vec<Tensors>,
    /// Ops it registers in the graph.
    ops: u64,
    formula: &'static str,
}

impl LayerSaved {
    fn tensors(&self) -> impl Iterator<Item = Tensors> + '_ {
        self.attention.iter().chain(&self.after_attention).copied()
    }
}

fn standard_layer(
    config: &LmConfig,
    coding: Coding,
    shape: StepShape,
    memory: DeviceMemory,
) -> LayerSaved {
    let dims = Dims::new(config, shape);
    // A counter linear registers 4 ops and a ternary one 3 where a dense one registers 2.
    let linears = config.block_linears() as u64;
    let coded_ops = match (coding.blocks, coding.ternary) {
        (true, _) => 2 * linears,
        (false, true) => linears,
        (false, false) => 0,
    };
    let bool_bytes = memory.bool_bytes();
    let mlp_matrices = config.mlp_matrices() as u64;
    // An adapted linear adds two matmuls, a scaling and a sum to the graph.
    let adapter_ops = match dims.lora_rank {
        Some(_) => 4 * linears,
        None => 0,
    };
    let norm = dims.norm_saved(dims.layers_train);
    // The output projection's input (flash attention's own output, in the layout that merges
    // its heads for free; a copy of Burn's), the MLP's norm and output, the MLP's own.
    let projection_input = match config.attention {
        AttentionKind::Burn => Some(dims.td(1)),
        AttentionKind::Flash => None,
    };
    let after_attention = projection_input
        .into_iter()
        .chain(norm.clone())
        .chain([dims.td(1)])
        .chain(dims.mlp_saved(config.mlp))
        .chain([dims.adapter_products(1 + mlp_matrices)])
        .collect();
    match config.attention {
        AttentionKind::Burn => LayerSaved {
            // The norm's, its output, q, and k and v repeated to every query head.
            attention: norm
                .into_iter()
                .chain([
                    dims.td(4),
                    dims.adapter_products(3),
                    Tensors::new(1, bool_bytes * dims.seq * dims.seq),
                    dims.scores(3),
                    dims.rows(1, dims.float),
                    dims.rows(1, 4),
                    dims.rows(2, bool_bytes),
                ])
                .collect(),
            after_attention,
            formula: "4·(10·T·d + c·T·d_ff + 3·B·H·S² + B·H·S + 4·T) + (4 + 2b)·B·H·S + b·S²",
            // Norms 2 × 7, q and k 13 each, v 4, attention 12, output 4, MLP 9, residuals 2;
            // repeating grouped heads 3 each for k and v.
            ops: 71 + coded_ops + adapter_ops - dims.fewer_block_ops(config.mlp, config.attention)
                + if config.n_kv_heads < config.n_heads {
                    6
                } else {
                    0
                },
        },
        AttentionKind::Flash => LayerSaved {
            // The norm's, its output, q and the attention's output; k and v; the log-sum-exp
            // (f32).
            attention: norm
                .into_iter()
                .chain(dims.keys_and_values())
                .chain([
                    dims.td(3),
                    dims.adapter_products(3),
                    Tensors::new(1, bool_bytes * dims.batch * dims.seq),
                    dims.rows(1, 4),
                ])
                .collect(),
            after_attention,
            formula: "4·(8·T·d + 2·T·d_kv + c·T·d_ff + B·H·S + 4·T) + b·B·S",
            // Keeping the values in codes, the attention is a handwritten node (one op before).
            ops: 60
                + coded_ops
                + adapter_ops
                + u64::from(dims.values != SavedPrecision::Full) * (HANDWRITTEN_NODE_OPS - 1)
                - dims.fewer_block_ops(config.mlp, config.attention),
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
    /// The float type of the weights, activations and gradients: f32, or bf16 or f16 (the
    /// optimizer's state is f32 whatever the weights, `OptimizerPlan::half_precision`).
    pub float: DType,
    /// The rank of LoRA adapters on the blocks' linears, when only they train (`lm::LoraConfig`).
    pub lora_rank: Option<usize>,
    /// Which of the model's weights train in this step.
    pub trained: TrainedWeights,
}

/// Which of the model's weights train in a step: block-coordinate training
/// ([`burn_memwall::optim::BlockCoordinate`] over [`LmConfig::coordinate_blocks`]) trains a
/// layer, or the token table with the final norm and the head, at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainedWeights {
    /// Every weight (with LoRA, every adapter).
    All,
    /// The layers' (the worst case of one layer training: a phase of the budget is one
    /// layer's); the token table, the final norm and the head are frozen.
    Layers,
    /// The token table's, the final norm's and the head's; the layers' are frozen.
    TableAndHead,
}

impl StepShape {
    /// `batch` sequences of `seq` tokens in `float`, every weight trained.
    pub fn new(batch: usize, seq: usize, float: DType) -> Self {
        Self {
            batch,
            seq,
            float,
            lora_rank: None,
            trained: TrainedWeights::All,
        }
    }

    /// `batch` sequences of `seq` tokens in f32.
    pub fn f32(batch: usize, seq: usize) -> Self {
        Self::new(batch, seq, DType::F32)
    }

    /// Only LoRA adapters of `rank` on the blocks' linears train, when `rank` is some.
    pub fn with_lora_rank(self, rank: Option<usize>) -> Self {
        Self {
            lora_rank: rank,
            ..self
        }
    }
}

/// What the forward pass of `config` keeps alive for the backward pass on a batch of `shape`,
/// with every parameter read through an in-backward hook when `routed`, on a device that holds
/// tensors as `memory` does (`b`, a bool's bytes, in the formulas).
///
/// # Errors
/// [`Error::InvalidConfig`] for the configurations whose memory is not modelled (see
/// `Coding::modelled`).
pub fn saved_activations(
    config: &LmConfig,
    shape: StepShape,
    routed: bool,
    memory: DeviceMemory,
) -> Result<Vec<Term>, Error> {
    let coding = Coding::modelled(config, shape, memory)?;
    let dims = Dims::new(config, shape);
    let layers = dims.layers;
    // The block weights an in-backward hook routes: the coded ones update themselves; with
    // LoRA, each adapter's two factors.
    let block_params = match shape.lora_rank {
        Some(_) => 2 * config.block_linears() as u64,
        None if !dims.layers_train => 0,
        None => coding.trained_block_weights(config).count() as u64,
    };
    let mut terms = Vec::new();
    // What the graph's host-side bookkeeping adds, on a device whose memory holds it.
    let mut host = Vec::new();
    let mut ops = 0;
    // Whether the loss keeps the final hidden states (see its terms below).
    let loss_keeps_hidden = match config.loss {
        LossKind::Burn => dims.table_and_head_train,
        LossKind::Fused => coding.table,
    };
    match config.blocks {
        BlockKind::Standard => {
            let layer = standard_layer(config, coding, shape, memory);
            terms.push(Term::of(
                Pool::SavedActivations,
                format!(
                    "{} layers, per layer: {}{}",
                    config.n_layers,
                    layer.formula,
                    dims.formula_note()
                ),
                (0..layers).flat_map(|_| layer.tensors()),
            ));
            terms.push(Term::of(
                Pool::SavedActivations,
                "final norm: input, x / rms, 2 columns: 4·(2·T·d + 2·T) (saving: 4·T, and its \
                 output 4·T·d where the loss lets it go)",
                dims.final_norm_saved(loss_keeps_hidden),
            ));
            ops += layers * layer.ops;
        }
        BlockKind::Reversible => {
            terms.push(Term::of(
                Pool::SavedActivations,
                "reversible chain output [T, 2d], stream mean, final norm: 4·(4·T·d + 2·T)",
                [dims.floats(1, 2 * dims.tokens * dims.d)]
                    .into_iter()
                    .chain(dims.final_norm_saved(loss_keeps_hidden)),
            ));
            // Half-precision chains keep every block's input rather than rebuild it
            // (`lm::reversible`: each inversion would lose a rounding).
            terms.push(Term::of(
                Pool::SavedActivations,
                "half precision: every block's input [T, 2d] kept",
                [dims.floats(u64::from(dims.half) * layers, 2 * dims.tokens * dims.d)],
            ));
            host.push(Term::new(
                Pool::Backend,
                format!("reversible chain: {CHAIN_BYTES_PER_BLOCK} B per block"),
                layers * CHAIN_BYTES_PER_BLOCK,
            ));
            // The embedding's copy into two streams, the chain and the stream mean.
            ops += 6;
        }
    }
    match (config.loss, coding.table) {
        (LossKind::Burn, _) => {
            let tied_copy = config.tie_embeddings && memory.copies_transposed_operands();
            terms.push(Term::of(
                Pool::SavedActivations,
                "Burn's loss: hidden (when the head trains), logits − max, a column (+ the tied \
                 head's transposed copy on Flex): 4·(T·d + T·V + T + 1) + 4·V·d if tied",
                [
                    dims.td(u64::from(dims.table_and_head_train)),
                    dims.floats(1, dims.tokens * dims.vocab),
                    dims.columns(1),
                    dims.floats(1, 1),
                    dims.vd(u64::from(tied_copy)),
                ],
            ));
            ops += 22;
        }
        (LossKind::Fused, false) => {
            terms.push(Term::of(
                Pool::SavedActivations,
                "fused loss: d_hidden and d_weight (when the head trains), computed in \
                 forward: 4·(T·d + V·d + 1)",
                [
                    dims.td(1),
                    dims.vd(u64::from(dims.table_and_head_train)),
                    dims.floats(1, 1),
                ],
            ));
            ops += 10;
        }
        (LossKind::Fused, true) => {
            // The coded head's gradient is its update, made in backward: the loss keeps the
            // hidden rows and a log-sum-exp per token; the coded embedding its ids on the host.
            terms.push(Term::of(
                Pool::SavedActivations,
                "counter head's loss: hidden rows, log-sum-exp; coded embedding: the ids \
                 (i64): 4·(T·d + T) + 8·T",
                [
                    dims.td(1),
                    dims.columns(1),
                    Tensors::new(1, 8 * dims.tokens),
                ],
            ));
            // The loss's and the coded embedding's together (measured).
            ops += 10;
        }
    }
    // Each loss's count includes the final norm's.
    ops -= dims.fewer_norm_ops();
    if routed {
        // One graph hook per parameter read outside the blocks: the embedding, the final norm
        // and the head (the final norm only when the table and head are coded; none when
        // they are frozen).
        ops += match (coding.table, dims.table_and_head_train) {
            (_, false) => 0,
            (true, true) => 1,
            (false, true) => 3,
        };
        match config.blocks {
            // And one per parameter read inside each standard block.
            BlockKind::Standard => ops += block_params * layers,
            // A reversible chain runs its blocks outside the graph and holds their uses itself.
            BlockKind::Reversible => host.push(Term::new(
                Pool::Backend,
                format!(
                    "in-backward uses held by the chain: {block_params} per block × \
                     {ROUTED_USE_BYTES} B"
                ),
                block_params * layers * ROUTED_USE_BYTES,
            )),
        }
    }
    host.push(Term::new(
        Pool::Backend,
        format!("autodiff graph on Flex: {ops} ops × {GRAPH_BYTES_PER_OP} B"),
        ops * GRAPH_BYTES_PER_OP,
    ));
    if memory.holds_the_graph() {
        terms.extend(host);
    }
    Ok(terms)
}

/// The parameters `config` builds, counted from its shapes without building it: what
/// [`ParameterCensus::of`] reads from the model (so a 70B config costs nothing to count), the
/// trained ones in the order the forward reads them: the token table, each block's, the final
/// norm, an untied head. Counter codes are counted as parameters that do not train. With
/// LoRA adapters of `lora_rank`, every weight of `config` is frozen and each block linear's
/// factors `A` `[d_in, rank]` and `B` `[rank, d_out]` train.
pub fn parameter_census(
    config: &LmConfig,
    float: DType,
    lora_rank: Option<usize>,
) -> ParameterCensus {
    let (coding, float) = (Coding::of(config), float.size() as u64);
    let (vocab, d) = (config.vocab_size, config.d_model);
    let base_trains = lora_rank.is_none();
    let mut census = ParameterCensus::default();
    let mut add = |bytes: u64, trains: bool| match trains {
        true => census.trained.push(bytes),
        false => census.untrained_bytes += bytes,
    };
    let table = match coding.table {
        true => (coded_bytes(vocab, d), false),
        false => (float * (vocab * d) as u64, base_trains),
    };
    add(table.0, table.1);
    for _ in 0..config.n_layers {
        for weight in config.block_weights() {
            match (weight, coding.blocks) {
                (BlockWeight::Matrix { d_out, d_in }, true) => add(coded_bytes(d_out, d_in), false),
                _ => add(float * weight.elements() as u64, base_trains),
            }
            if let (BlockWeight::Matrix { d_out, d_in }, Some(rank)) = (weight, lora_rank) {
                add(float * (d_in * rank) as u64, true);
                add(float * (rank * d_out) as u64, true);
            }
        }
    }
    add(float * d as u64, base_trains);
    if !config.tie_embeddings {
        add(table.0, table.1);
    }
    census
}

/// The largest of `config`'s [`LmConfig::coordinate_blocks`] among those `trained` names, in
/// `census` (from [`parameter_census`]): its parameters train, the others count as frozen.
///
/// # Errors
/// LoRA adapters or counter codes: not modelled with block-coordinate training.
fn largest_coordinate_block(
    config: &LmConfig,
    lora_rank: Option<usize>,
    trained: TrainedWeights,
    census: &ParameterCensus,
) -> Result<ParameterCensus, Error> {
    if lora_rank.is_some() || config.linear != LinearKind::Dense {
        return Err(Error::InvalidConfig(
            "block-coordinate training is modelled for dense models without LoRA".into(),
        ));
    }
    // The census's order: the table, each block's weights, the final norm, an untied head.
    let per_layer = config.block_weights().len();
    let (table, rest) = census.trained.split_at(1);
    let (layers, output) = rest.split_at(per_layer * config.n_layers);
    let blocks: Vec<Vec<u64>> = match trained {
        TrainedWeights::Layers => layers.chunks(per_layer).map(<[u64]>::to_vec).collect(),
        _ if config.tie_embeddings => vec![[table, output].concat()],
        _ => vec![table.to_vec(), output.to_vec()],
    };
    let largest = blocks
        .into_iter()
        .max_by_key(|block| block.iter().sum::<u64>())
        .unwrap_or_default();
    let frozen = census.trained.iter().sum::<u64>() - largest.iter().sum::<u64>();
    Ok(ParameterCensus {
        trained: largest,
        untrained_bytes: census.untrained_bytes + frozen,
    })
}

/// The weights on the device when those of the blocks not training wait in host memory
/// (`census` all of them, `stepped` the training block's): the training block's, the token
/// table when it is tied to the head (pinned), one waiting layer's copies (the reversible
/// chain's forward reads one block at a time, and its backward recomputes one at a time), and
/// an untied head's copy when the head waits (the fused loss keeps the head it read for its
/// backward; with the table training, the larger of the two is counted as the one waiting). A
/// waiting table is read on the host, its rows only crossing.
///
/// # Errors
/// Standard blocks, whose frozen layers above the training one keep the copies they read
/// until their backward step: not modelled.
fn weights_on_the_device(
    config: &LmConfig,
    shape: StepShape,
    census: &ParameterCensus,
    stepped: &ParameterCensus,
) -> Result<Term, Error> {
    if config.blocks != BlockKind::Reversible {
        return Err(Error::InvalidConfig(
            "weights in host memory are modelled with reversible blocks only".into(),
        ));
    }
    let largest_layer =
        largest_coordinate_block(config, shape.lora_rank, TrainedWeights::Layers, census)?;
    let table = census.trained[0];
    let (head, waiting_output) = match (config.tie_embeddings, shape.trained) {
        (true, TrainedWeights::Layers) => (table, 0),
        (true, _) => (0, 0),
        (false, TrainedWeights::Layers) => (0, *census.trained.last().unwrap_or(&0)),
        (false, _) => (0, table.max(*census.trained.last().unwrap_or(&0))),
    };
    Ok(Term::of(
        Pool::Parameters,
        "the training block's weights, a tied table, one waiting layer's copies and a waiting \
         head's",
        stepped
            .trained
            .iter()
            .chain(&largest_layer.trained)
            .chain([&head, &waiting_output, &census.untrained_bytes])
            .map(|&bytes| Tensors::new(1, bytes)),
    )
    .placed(Placement::Slots))
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
/// with every term alive then (derived in docs/memory-model/peak-phases.md, and for pools
/// docs/memory-model/cube-pools.md).
///
/// The phases, in the order they happen:
/// - **fused loss, forward** (fused loss): the worst chunk, its logits and weight-gradient share
///   beside everything the model saved;
/// - **loss backward** (Burn's loss): two `[T, vocab]` buffers beside the saved logits;
/// - **head backward** (Burn's loss): the head's weight gradient, made per batch and summed;
/// - **MLP backward** and **attention backward** (standard blocks), for each block from the
///   last to the first: the activations of the blocks not walked yet, the gradients already
///   made, the op's output;
/// - **MLP recompute** and **attention recompute** (reversible blocks), for each block from the
///   last to the first: the sub-block rebuilt with its activations and its backward run;
/// - **embedding backward**: a zeroed `[vocab, d]` gradient beside every gradient kept;
/// - **optimizer step** (after backward): every gradient and the update's temporaries.
///
/// Left out, each small next to these here: the graph's bookkeeping while backward runs, the
/// matmul's own packing buffers, the in-backward hand-over maps.
///
/// # Errors
/// [`Error::InvalidConfig`] for the configurations whose memory is not modelled (see
/// `Coding::modelled`) and for optimizer state or waiting weights in host memory on Flex (refused
/// there), and
/// [`Error::SequenceTooLong`] for a sequence longer than the model's context.
pub fn step_budget(
    config: &LmConfig,
    optimizer: &OptimizerPlan,
    shape: StepShape,
    memory: DeviceMemory,
) -> Result<Budget, Error> {
    if optimizer.one_block_at_a_time.is_none() {
        return trained_step_budget(config, optimizer, shape, memory);
    }
    // The worst block's step: a layer's, or the table's and head's.
    let mut worst: Option<Budget> = None;
    for trained in [TrainedWeights::Layers, TrainedWeights::TableAndHead] {
        let shape = StepShape { trained, ..shape };
        let budget = trained_step_budget(config, optimizer, shape, memory)?;
        if worst
            .as_ref()
            .is_none_or(|worst| budget.peak() > worst.peak())
        {
            worst = Some(budget);
        }
    }
    Ok(worst.expect("two cases"))
}

/// [`step_budget`] with the weights that `shape` says train.
fn trained_step_budget(
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
    let coding = Coding::modelled(config, shape, memory)?;
    if (optimizer.host_offload.is_some() || optimizer.inactive_weights_on_host)
        && memory == DeviceMemory::Heap
    {
        return Err(Error::InvalidConfig(
            "optimizer state or weights in host memory need a device with memory of its own: on \
             Flex the device's memory is the host's, and the offload is refused"
                .into(),
        ));
    }
    if optimizer.half_precision.is_some() != (shape.float.size() == 2) {
        return Err(Error::InvalidConfig(format!(
            "the optimizer plan's weights ({:?}) are not the step's {:?}",
            optimizer.half_precision, shape.float
        )));
    }
    let census = parameter_census(config, shape.float, shape.lora_rank);
    // What the optimizer keeps state for and updates.
    let stepped = match shape.trained {
        TrainedWeights::All => census.clone(),
        trained => largest_coordinate_block(config, shape.lora_rank, trained, &census)?,
    };
    let after = optimizer.timing == UpdateTiming::AfterBackward;
    let saved = saved_activations(config, shape, !after, memory)?;
    let dims = Dims::new(config, shape);
    let Dims {
        batch,
        seq,
        tokens,
        d,
        d_ff,
        vocab,
        layers,
        ..
    } = dims;
    let copies = memory.output_copies();
    // Flex multiplies bf16 matrices in f32 (burn-flex's `matmul_bf16`): a matmul holds f32
    // copies of both operands and makes its output in f32 before rounding it. The phases list
    // each output as made in the float type (2 bytes, `copies` times); in f32 it is 4 bytes
    // more per element. Each phase that runs matmuls adds its largest's, `[lhs, rhs, out]` in
    // elements.
    let converts = memory == DeviceMemory::Heap && shape.float == DType::BF16;
    let f32_copies = |matmuls: &[[u64; 3]]| {
        let bytes = |[lhs, rhs, out]: [u64; 3]| 4 * (lhs + rhs + out);
        let largest = matmuls.iter().copied().map(bytes).max().unwrap_or(0);
        u64::from(converts) * largest
    };
    let f32_matmul = |what: &str, matmuls: &[[u64; 3]]| {
        Term::new(
            Pool::Workspace,
            format!("Flex's bf16 matmul in f32 ({what}): both operands and the output"),
            f32_copies(matmuls),
        )
    };
    // The input's and, when the weight trains, the weight's gradient of a `[d_in] → [d_out]`
    // linear.
    let linear_backward = |d_in: u64, d_out: u64| {
        let input = [tokens * d_out, d_in * d_out, tokens * d_in];
        let weight_batches = weight_gradient_batches(batch, seq, d_out);
        let weight = [tokens * d_out, tokens * d_in, weight_batches * d_in * d_out];
        match dims.layers_train {
            true => vec![input, weight],
            false => vec![input],
        }
    };
    let graph = |ops: u64| match memory.holds_the_graph() {
        true => ops * GRAPH_BYTES_PER_OP,
        false => 0,
    };
    let fd = dims.floats(1, d_ff * d).bytes;
    // A dense linear's weight gradient of `bytes`, made as one tensor over `batches` (see
    // [`weight_gradient_batches`]) and then summed beside it. On a heap, which holds a new output
    // twice, its creation is the larger moment; on pools the sum (lavapipe, `small`: the 1.57 MB
    // sum beside its 3.15 MB batches, on one page in the down projection's backward).
    let weight_gradient = |batches: u64, bytes: u64| match memory {
        DeviceMemory::Heap => vec![Tensors::new(copies * batches, bytes)],
        DeviceMemory::Pools if batches > 1 => {
            vec![Tensors::new(1, batches * bytes), Tensors::new(1, bytes)]
        }
        DeviceMemory::Pools => vec![Tensors::new(1, bytes)],
    };
    let mlp_matrices = config.mlp_matrices() as u64;
    let (layers_train, head_trains) = (dims.layers_train, dims.table_and_head_train);
    // The trained weights of one block: with LoRA, its adapters' factors.
    let block: Vec<Tensors> = match shape.lora_rank {
        Some(rank) => config
            .block_weights()
            .into_iter()
            .filter(|weight| matches!(weight, BlockWeight::Matrix { .. }))
            // A and B together (the budget places them on Flex's heap only).
            .map(|weight| dims.floats(1, weight.adapter_elements(rank) as u64))
            .collect(),
        None if !layers_train => Vec::new(),
        None => coding
            .trained_block_weights(config)
            .map(|weight| dims.floats(1, weight.elements() as u64))
            .collect(),
    };
    // The gradients of the MLP's and the output projection's weights (after backward, before
    // the attention's backward).
    let (mlp_gradients, output_projection_gradient) = match shape.lora_rank {
        Some(rank) => {
            let adapter = |d_out, d_in| BlockWeight::Matrix { d_out, d_in }.adapter_elements(rank);
            let (d, d_ff) = (config.d_model, config.d_ff);
            (
                dims.floats(mlp_matrices, adapter(d_ff, d) as u64),
                dims.floats(1, adapter(d, d) as u64),
            )
        }
        None => (
            Tensors::new(u64::from(layers_train) * mlp_matrices, fd),
            dims.floats(u64::from(layers_train), d * d),
        ),
    };
    // The attention's matmuls: the projections' backward, and Burn's attention's scores.
    let attention_matmuls: Vec<[u64; 3]> = linear_backward(d, d)
        .into_iter()
        .chain(match config.attention {
            AttentionKind::Burn => Some([tokens * d, tokens * d, batch * dims.heads * seq * seq]),
            AttentionKind::Flash => None,
        })
        .collect();
    // What a rebuilt norm keeps beside its input and output: Burn's `x / rms`, two columns and
    // in half precision an f32 copy of its input; the saving norm one f32 per row.
    let rebuilt_norm = match dims.savers {
        SaverKind::Burn => vec![
            dims.td(1),
            dims.columns(2),
            Tensors::new(u64::from(dims.half), 4 * tokens * d),
        ],
        SaverKind::Exact => vec![Tensors::new(1, 4 * tokens)],
    };
    let tied = config.tie_embeddings;
    // The token table and the head are dense weights that train.
    let table_trains = !coding.table && head_trains;

    let rope_tables = match config.blocks {
        BlockKind::Standard => 1,
        // The model's and the chain's.
        BlockKind::Reversible => 2,
    };
    let matrices = coding.matrices(config);
    let codes: Vec<Tensors> = matrices
        .iter()
        .flat_map(|&[d_out, d_in]| code_tensors(d_out, d_in))
        .collect();
    let code_bytes: u64 = codes.iter().map(|tensors| tensors.total_bytes()).sum();
    let parameters = match optimizer.inactive_weights_on_host {
        false => Term::of(
            Pool::Parameters,
            "parameters",
            census
                .trained
                .iter()
                .map(|&bytes| Tensors::new(1, bytes))
                .chain([Tensors::new(1, census.untrained_bytes - code_bytes)]),
        )
        .placed(Placement::Slots),
        true => weights_on_the_device(config, shape, &census, &stepped)?,
    };
    // A coded matrix is drawn as a dense f32 weight while the persistent window is open, read
    // back and encoded on the host, and its codes made after the window closes: the draws
    // leave their slots, the reads their staging pages, and the codes lie on the pages.
    let draws = matrices
        .iter()
        .map(|&[d_out, d_in]| (4 * d_out * d_in) as u64);
    let (draw_slots, draw_copies) = match memory {
        DeviceMemory::Heap => (Vec::new(), Vec::new()),
        DeviceMemory::Pools => (persistent_slots(draws.clone()), read_back_pages(draws)),
    };
    let state_of = match optimizer.one_block_at_a_time {
        Some(InactiveState::Kept) => &census,
        _ => &stepped,
    };
    let persistent = [
        parameters,
        Term::of(
            Pool::Backend,
            "the copies the waiting blocks' weights are read back through",
            match optimizer.inactive_weights_on_host {
                true => census.read_back_copies(),
                false => Vec::new(),
            },
        )
        .placed(Placement::Staging),
        Term::of(
            Pool::Parameters,
            "counter codes: each matrix's words, its rows' scales and mean squares",
            codes,
        ),
        Term::of(
            Pool::Backend,
            "the coded matrices' f32 draws: an empty persistent slot of each size",
            draw_slots,
        )
        .placed(Placement::Slots),
        Term::of(
            Pool::Backend,
            "the copies the draws are read back through to be encoded",
            draw_copies,
        )
        .placed(Placement::Staging),
        Term::new(
            Pool::Backend,
            format!(
                "counter codes' shared state in host memory: {CODED_MATRIX_BYTES} B per coded \
                 matrix"
            ),
            u64::from(memory == DeviceMemory::Heap) * matrices.len() as u64 * CODED_MATRIX_BYTES,
        ),
        optimizer.replaced_parameters(&stepped, memory),
        Term::of(
            Pool::Buffers,
            format!("{rope_tables} rotary table(s) of 2·max_seq·d_head floats; the batch's ids"),
            [
                dims.floats(
                    rope_tables,
                    2 * (config.max_seq_len * config.d_head()) as u64,
                ),
                Tensors::new(2, 4 * tokens),
            ],
        ),
        // A kept state is every block's (in host memory with the offload, where each block's
        // largest parameter may come to the device and leave a read-back copy of each size).
        optimizer.state(state_of),
        optimizer.read_back_copies(state_of),
    ];
    let phase = |name: &'static str, terms: Vec<Term>| Phase {
        name,
        terms: persistent.iter().cloned().chain(terms).collect(),
    };
    let workspace = |what: String, tensors: Vec<Tensors>| Term::of(Pool::Workspace, what, tensors);
    // The gradients of a dense head, the final norm and the blocks after block `l`.
    let gradients_after = |l: u64| {
        [
            dims.vd(u64::from(table_trains)),
            dims.floats(u64::from(head_trains), d),
        ]
        .into_iter()
        .chain((l + 1..layers).flat_map(|_| block.iter().copied()))
    };
    // The gradients alive when backward reaches block `l`: the head's and final norm's, and
    // every later block's (after backward); in backward only the tied table's head share,
    // which waits for the embedding's.
    let gradients_at = |l: u64| match (after, tied && table_trains) {
        (true, _) => Term::of(
            Pool::Gradients,
            format!("head, final norm and {} later block(s)", layers - 1 - l),
            gradients_after(l),
        ),
        (false, true) => Term::of(
            Pool::Gradients,
            "the tied table's head share, until the embedding's backward",
            [dims.vd(1)],
        ),
        (false, false) => Term::new(Pool::Gradients, "none: each applied when made", 0),
    };
    // The larger of two sets of tensors.
    let larger = |a: Vec<Tensors>, b: Vec<Tensors>| {
        let bytes = |set: &[Tensors]| set.iter().map(|t| t.total_bytes()).sum::<u64>();
        match bytes(&a) >= bytes(&b) {
            true => a,
            false => b,
        }
    };
    // The down projection's backward: the MLP-input gradient and the weight's share.
    let down_backward = match (coding.blocks, coding.ternary) {
        // A frozen dense weight with LoRA: no weight gradient; the adapter's share of the input
        // gradient (made first: its ops are newer) beside the weight's share as it is made.
        (false, false) if shape.lora_rank.is_some() => vec![dims.tf(1), dims.tf(copies)],
        // A frozen dense weight: the input gradient, made `copies` times.
        (false, false) if !layers_train => vec![dims.tf(1), dims.tf(copies - 1)],
        // Dense: the input gradient, and the weight gradient made per batch or the input
        // gradient's second copy, whichever is larger.
        (false, false) => {
            let per_batch = weight_gradient(weight_gradient_batches(batch, seq, d), fd);
            let second = dims.tf(copies - 1);
            [dims.tf(1)]
                .into_iter()
                .chain(larger(vec![second], per_batch))
                .collect()
        }
        // Ternary: the ternary weight recomputed beside the input gradient as it is made, or
        // the input gradient beside the weight gradient (one 2-D matmul) as it is made.
        (false, true) => larger(
            vec![Tensors::new(1, fd), dims.tf(copies)],
            vec![dims.tf(1), Tensors::new(copies, fd)],
        ),
        // Coded: the input gradient summed over the code's row blocks, each decoded into a
        // buffer (a running sum and a new part once there is more than one block), or the
        // finished input gradient beside one block's weight gradient, which the update uses
        // and frees.
        (true, _) => {
            let rows = block_rows(config.d_ff).min(config.d_model);
            let block = dims.floats(1, rows as u64 * d_ff).bytes;
            let parts = copies + u64::from(config.d_model > rows);
            larger(
                vec![dims.tf(parts), Tensors::new(1, block)],
                vec![dims.tf(1), Tensors::new(copies, block)],
            )
        }
    };
    // The MLP's backward peaks at the down projection's, or with the saving ops at the
    // activation's, once the down projection has given its input back; Flex's f32 copies of a
    // bf16 matmul come on top (`down_matmuls`). The node that recomputes the product holds
    // the down projection's backward and the product beside it, with its matmuls' copies,
    // then the activation's three gradients at once (the product's, and the up projection's
    // and the gate's, made in one pass) beside the weight's gradient, with none.
    // In low bits the node first restores what it kept, beside its codes' place: SwiGLU's
    // two inputs, or ReLU²'s `relu(u)`, which its node squares again for the weight's gradient
    // and then multiplies into the input gradient (`dh`, `dh·r`, `2·dh·r`).
    let restored = match (dims.mlp_codes, config.mlp) {
        (false, _) => 0,
        (true, MlpKind::SwiGlu) => 2,
        (true, MlpKind::ReluSquared) => 1,
    };
    let (mlp_backward, down_matmuls) = match (dims.recomputes_product, dims.mlp_codes) {
        (true, _) => {
            let in_f32 = Tensors::new(1, f32_copies(&linear_backward(d_ff, d)));
            let matmuls = down_backward
                .into_iter()
                .chain([dims.tf(1 + restored), in_f32])
                .collect();
            let activation = vec![dims.tf(3 + restored), Tensors::new(1, fd)];
            (larger(matmuls, activation), Vec::new())
        }
        (false, true) => {
            let matmuls = down_backward
                .into_iter()
                .chain([dims.tf(1 + restored)])
                .collect();
            let activation = vec![dims.tf(3), Tensors::new(1, fd)];
            (larger(matmuls, activation), Vec::new())
        }
        (false, false) => (
            larger(down_backward, dims.activation_backward(config.mlp)),
            linear_backward(d_ff, d),
        ),
    };
    // Flash attention's values restored from their codes for its backward.
    let restored_values = dims.td_kv(u64::from(dims.values != SavedPrecision::Full));
    // Flex's flash attention computes in f32 (`ops/flash_attention/flex.rs`): in half
    // precision its backward holds f32 copies of q and dO (`[T, d]`) and of k and v
    // (`[T, d_kv]`; its output's copy goes once the row dots are made), and makes dq, dk and dv
    // in f32, 2 bytes an element more than the phases count them.
    let flash_in_f32 = match memory == DeviceMemory::Heap && dims.half {
        true => vec![
            Tensors::new(2, 4 * tokens * d),
            Tensors::new(2, 4 * tokens * dims.d_kv),
            Tensors::new(1, 2 * tokens * d),
            Tensors::new(2, 2 * tokens * dims.d_kv),
        ],
        false => Vec::new(),
    };

    let mut phases = Vec::new();
    match (config.loss, coding.table) {
        (LossKind::Fused, true) => {
            // The coded head's loss walks the vocabulary a block of rows at a time in backward.
            let rows = counter_loss_block_rows(config.vocab_size, tokens as usize, config.d_model);
            let mut terms = saved.clone();
            terms.push(workspace(
                format!(
                    "hidden-state gradient and its new part; a {rows}-row block of the head \
                     decoded, its codes copied, its logits"
                ),
                vec![
                    dims.td(1 + copies),
                    dims.floats(1, rows as u64 * d),
                    Tensors::new(1, coded_bytes(rows, config.d_model)),
                    dims.floats(1, tokens * rows as u64),
                ],
            ));
            phases.push(phase("counter loss, backward", terms));
        }
        (LossKind::Fused, false) => {
            let chunk = (FusedCrossEntropyOptions::default().chunk_tokens(vocab as usize) as u64)
                .min(tokens);
            let logits = dims.floats(1, chunk * vocab);
            // The first chunk writes the weight gradient's running sum; later ones add to it.
            let first_only = u64::from(chunk == tokens);
            let chunk_output =
                match logits.bytes + copies * dims.vd(1).bytes >= copies * logits.bytes {
                    // A frozen head takes no weight-gradient share.
                    _ if !head_trains => vec![Tensors::new(copies, logits.bytes)],
                    true => vec![logits, dims.vd(copies - first_only)],
                    false => vec![
                        Tensors::new(copies - 1, logits.bytes),
                        Tensors::new(1, logits.bytes - first_only * dims.vd(1).bytes),
                    ],
                };
            let mut terms = saved.clone();
            terms.push(workspace(
                format!(
                    "hidden states, a {chunk}-token chunk's rows, its logits and weight-gradient \
                     share"
                ),
                [dims.td(1), dims.floats(1, chunk * d)]
                    .into_iter()
                    .chain(chunk_output)
                    .collect(),
            ));
            terms.push(f32_matmul(
                "a chunk's logits",
                &[[chunk * d, vocab * d, chunk * vocab]],
            ));
            phases.push(phase("fused loss, forward", terms));
        }
        (LossKind::Burn, _) => {
            let mut terms = saved.clone();
            terms.push(workspace(
                "two [T, vocab] buffers (gather's zeros, the log-softmax gradient)".into(),
                vec![dims.floats(2, tokens * vocab)],
            ));
            phases.push(phase("loss backward", terms));
            let vd = dims.vd(1).bytes;
            // A matmul by the table broadcast over the batch: its gradient is one
            // [B, d, vocab] tensor, summed after.
            let weight_gradient = match (tied, memory) {
                // A frozen head takes no gradient.
                _ if !head_trains => Vec::new(),
                // Held twice at its creation, less the table's transposed copy, freed first.
                (true, DeviceMemory::Heap) => vec![
                    Tensors::new(1, batch * vd),
                    Tensors::new(1, (batch - 1) * vd),
                ],
                // Beside its sum (lavapipe: a 12 MiB reservation at each backward on `small`).
                (true, DeviceMemory::Pools) => vec![Tensors::new(1, batch * vd), dims.vd(1)],
                (false, _) => weight_gradient(weight_gradient_batches(batch, seq, vocab), vd),
            };
            let mut terms = saved.clone();
            terms.push(workspace(
                "hidden-state gradient, the head's weight gradient made per batch".into(),
                [dims.td(1)].into_iter().chain(weight_gradient).collect(),
            ));
            terms.push(f32_matmul("the head's", &linear_backward(d, vocab)));
            phases.push(phase("head backward", terms));
        }
    }
    match config.blocks {
        BlockKind::Standard => {
            let layer = standard_layer(config, coding, shape, memory);
            // What blocks 0..l hold whole, and block l holds in `last`, with their graph.
            let saved_to = |l: u64, last: &[Tensors], what: String| {
                vec![
                    Term::of(
                        Pool::SavedActivations,
                        what,
                        (0..l)
                            .flat_map(|_| layer.tensors())
                            .chain(last.iter().copied()),
                    ),
                    Term::new(
                        Pool::Backend,
                        "their autodiff graph",
                        graph((l + 1) * layer.ops),
                    ),
                ]
            };
            let whole: Vec<Tensors> = layer.tensors().collect();
            let mlp_backward_at = |l: u64| {
                let mut terms = saved_to(l, &whole, format!("blocks 0..={l}"));
                terms.push(gradients_at(l));
                terms.push(workspace(
                    format!(
                        "block {l}: output gradient, and the down projection's backward (the \
                         MLP-input gradient, the weight's share) or a saving activation's"
                    ),
                    [dims.td(1)]
                        .into_iter()
                        .chain(mlp_backward.iter().copied())
                        .collect(),
                ));
                terms.push(f32_matmul("the down projection's", &down_matmuls));
                phase("MLP backward", terms)
            };
            let attention_backward_at = |l: u64| {
                // Block l's MLP has given back its activations, its norm's and its input.
                let mut terms = saved_to(
                    l,
                    &layer.attention,
                    format!("blocks 0..{l}, and block {l}'s attention part"),
                );
                terms.push(gradients_at(l));
                if after && !coding.blocks {
                    terms.push(Term::of(
                        Pool::Gradients,
                        format!("block {l}'s MLP and output projection"),
                        [mlp_gradients, output_projection_gradient],
                    ));
                }
                let op = match config.attention {
                    AttentionKind::Burn => vec![dims.scores(copies)],
                    AttentionKind::Flash => [
                        dims.td(1),
                        dims.td_kv(3),
                        dims.floats(4, SCORE_TILE),
                        restored_values,
                    ]
                    .into_iter()
                    .chain(flash_in_f32.iter().copied())
                    .collect(),
                };
                terms.push(workspace(
                    format!(
                        "block {l}: two activation gradients and the attention backward's buffers"
                    ),
                    [dims.td(2)].into_iter().chain(op).collect(),
                ));
                terms.push(f32_matmul("the attention's", &attention_matmuls));
                phase("attention backward", terms)
            };
            for l in (0..layers).rev() {
                phases.push(mlp_backward_at(l));
                phases.push(attention_backward_at(l));
            }
        }
        BlockKind::Reversible => {
            // The loss, the final norm and the chain's output are consumed by now; the chain's
            // handles, in-backward uses and graph remain.
            let chain: Vec<Term> = saved
                .iter()
                .filter(|term| term.pool == Pool::Backend)
                .cloned()
                .collect();
            // In half precision, the inputs kept for blocks 0..=b.
            let anchors = |b: u64| {
                Term::of(
                    Pool::SavedActivations,
                    format!("the inputs kept for blocks 0..={b}"),
                    [dims.floats(u64::from(dims.half) * (b + 1), 2 * tokens * d)],
                )
            };
            let mlp_recompute_at = |b: u64| {
                let mut terms = chain.clone();
                terms.push(anchors(b));
                terms.push(gradients_at(b));
                terms.push(workspace(
                    format!(
                        "block {b}: the walk's y, dy; the MLP rebuilt (norm, output and its \
                         gradient, c [T, d_ff]); the down projection's or a saving activation's \
                         backward"
                    ),
                    std::iter::once(dims.td(7))
                        .chain(dims.mlp_saved(config.mlp))
                        .chain(mlp_backward.iter().copied())
                        .chain(rebuilt_norm.iter().copied())
                        .collect(),
                ));
                terms.push(f32_matmul("the down projection's", &down_matmuls));
                phase("MLP recompute", terms)
            };
            let attention_recompute_at = |b: u64| {
                let mut terms = chain.clone();
                terms.push(anchors(b));
                terms.push(gradients_at(b));
                if after && !coding.blocks {
                    terms.push(Term::of(
                        Pool::Gradients,
                        format!("block {b}'s MLP"),
                        [mlp_gradients],
                    ));
                }
                let attention = match config.attention {
                    AttentionKind::Burn => vec![
                        dims.td(12),
                        dims.scores(3 + copies),
                        dims.rows(3, 4),
                        Tensors::new(1, memory.bool_bytes() * seq * seq),
                    ],
                    AttentionKind::Flash => {
                        [dims.td(12), dims.td_kv(5), dims.floats(4, SCORE_TILE)]
                            .into_iter()
                            .chain(flash_in_f32.iter().copied())
                            .collect()
                    }
                };
                // A coded output projection updates itself a block of rows at a time.
                let output_projection = match coding.blocks {
                    true => Tensors::new(0, 0),
                    false => output_projection_gradient,
                };
                terms.push(workspace(
                    format!(
                        "block {b}: the walk's state, the attention rebuilt and its backward, \
                         a dense output projection's gradient"
                    ),
                    attention
                        .into_iter()
                        .chain([output_projection])
                        .chain(rebuilt_norm.iter().copied())
                        .collect(),
                ));
                terms.push(f32_matmul("the attention's", &attention_matmuls));
                phase("attention recompute", terms)
            };
            for b in (0..layers).rev() {
                phases.push(mlp_recompute_at(b));
                phases.push(attention_recompute_at(b));
            }
        }
    }
    // The head's share holds a dense tied table's gradient, which the embedding's adds to.
    let kept: Vec<Tensors> = match (after, tied && table_trains) {
        (true, _) => gradients_after(0).chain(block.iter().copied()).collect(),
        (false, true) => vec![dims.vd(1)],
        (false, false) => Vec::new(),
    };
    let embedding = match coding.table {
        false => workspace(
            "the embedding's output gradient and its zeroed [vocab, d] gradient (none when \
             frozen)"
                .into(),
            vec![dims.td(1), dims.vd(copies * u64::from(head_trains))],
        ),
        // A coded table updates itself a zeroed block of rows at a time.
        true => workspace(
            "the embedding's output gradient and its sum, a zeroed block of rows".into(),
            vec![
                dims.td(2),
                dims.floats(
                    copies,
                    (block_rows(config.d_model).min(config.vocab_size) * config.d_model) as u64,
                ),
            ],
        ),
    };
    phases.push(phase(
        "embedding backward",
        vec![
            Term::of(Pool::Gradients, "every gradient kept so far", kept),
            embedding,
        ],
    ));
    if after {
        phases.push(phase(
            "optimizer step",
            vec![
                optimizer.gradients(&stepped),
                optimizer.update_temporaries(&stepped),
            ],
        ));
    }
    Ok(Budget { phases, memory })
}
