//! Configuration of the reference language model and its named sizes.

use burn::config::Config;
use burn_memwall::ops::saved_rows::SavedPrecision;
use serde::{Deserialize, Serialize};

use super::LinearKind;
use crate::Error;

/// Feed-forward block of each layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MlpKind {
    /// `W2 · (silu(W1 x) ∘ W3 x)`: three matrices (Llama).
    SwiGlu,
    /// `W2 · relu(W1 x)²`: two matrices (Primer; GPT-2's parameter count).
    ReluSquared,
}

/// How each layer computes attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionKind {
    /// `burn::tensor::module::attention`: under autodiff it keeps `[batch, heads, seq, seq]`
    /// scores and probabilities for the backward pass.
    Burn,
    /// `burn_memwall::ops::flash_attention`: saves the output and one log-sum-exp per row, and
    /// reads grouped key/value heads without repeating them.
    Flash,
}

/// How the blocks keep what the backward pass needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockKind {
    /// Pre-norm residual blocks, `x + attn(norm(x))` then `x + mlp(norm(x))`: every block's
    /// activations are kept, so their memory grows with depth.
    Standard,
    /// Additive couplings on two streams of the full width (RevNet, Reformer): both start as
    /// the embedding's output, each block adds `F` = the attention sub-block to one and `G` =
    /// the MLP sub-block to the other, and the final norm reads their mean.
    /// `burn_memwall::nn::ReversibleSequence` keeps only the last block's output and rebuilds
    /// the rest in backward. The same parameters as the standard blocks, in another
    /// architecture (the weights of one do not compute the other's function).
    Reversible,
}

/// How the training loss turns the final hidden states into a cross-entropy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossKind {
    /// The head's full `[batch · seq, vocab]` logits, then `burn::nn::loss::CrossEntropyLoss`:
    /// under autodiff the logits, their log-softmax and their gradient are all held.
    Burn,
    /// `burn_memwall::nn::FusedLinearCrossEntropyLoss`: chunk by chunk from the hidden states
    /// and the head's weight, never holding more than one chunk of logits.
    Fused,
}

/// What the norms and the MLP's activation keep for the backward pass (the values are the
/// same for both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SaverKind {
    /// Burn's autodiff of the composed ops: each RMSNorm keeps `x / rms` and two columns per
    /// row besides its input (and in half precision an f32 copy of it), SwiGLU `σ(gate·x)` and
    /// `silu(gate·x)` besides its two inputs, ReLU² its ReLU.
    Burn,
    /// `burn_memwall::ops::{rms_norm, swiglu, relu_squared}`: each RMSNorm keeps one f32 per
    /// row beside its output (which the linears reading it keep anyway), SwiGLU its two inputs
    /// (with dense linears, `swiglu_linear`: the down projection recomputes the product rather
    /// than keep it), ReLU² nothing but its output (which the down projection keeps anyway).
    Exact,
}

/// A decoder-only transformer: token embedding, `n_layers` pre-norm blocks of causal
/// grouped-query attention with rotary positions and an MLP, a final RMSNorm and the LM head.
#[derive(Config, Debug, PartialEq)]
pub struct LmConfig {
    /// Number of token ids the embedding and the head cover (including added tokens).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads; `d_model` must be a multiple.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); `n_heads` must be a multiple.
    pub n_kv_heads: usize,
    /// Hidden width of the MLP.
    pub d_ff: usize,
    /// Longest sequence the model accepts (the rotary table's length).
    pub max_seq_len: usize,
    /// Attention implementation (the weights are the same for both).
    #[config(default = "AttentionKind::Burn")]
    pub attention: AttentionKind,
    /// Training loss implementation (the weights and the value are the same for both).
    #[config(default = "LossKind::Burn")]
    pub loss: LossKind,
    /// Standard or reversible blocks.
    #[config(default = "BlockKind::Standard")]
    pub blocks: BlockKind,
    /// How the blocks' linears hold and train their weights.
    #[config(default = "LinearKind::Dense")]
    pub linear: LinearKind,
    /// What the norms and the MLP's activation keep for backward.
    #[config(default = "SaverKind::Burn")]
    pub savers: SaverKind,
    /// How the MLP's activation keeps what its backward reads where the down projection is
    /// dense (SwiGLU's two inputs, `burn_memwall::ops::swiglu::swiglu_linear`; ReLU²'s
    /// `relu(u)`, `burn_memwall::ops::relu_squared::relu_squared_linear`), and flash
    /// attention its values (`burn_memwall::ops::flash_attention::flash_attention_saving_values`):
    /// in full, or in 8 or 4 bits rounded stochastically (under `Int4` the values and ReLU²'s
    /// `relu(u)` keep 8: `values_precision`, `mlp_precision`). Needs `savers =
    /// Exact`; quantised down projections and Burn's attention keep theirs in full.
    #[config(default = "SavedPrecision::Full")]
    pub saved_precision: SavedPrecision,
    /// Feed-forward block.
    #[config(default = "MlpKind::SwiGlu")]
    pub mlp: MlpKind,
    /// Share the token-embedding table with the LM head.
    #[config(default = true)]
    pub tie_embeddings: bool,
    /// Base of the rotary position frequencies.
    #[config(default = 10000.0)]
    pub rope_theta: f32,
    /// Epsilon of every RMSNorm.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
}

/// The named sizes, smallest first.
pub const PRESETS: [&str; 4] = ["tiny", "small", "gpt2-124m", "llama-1b"];

/// Published Llama-family shapes by size, for the memory budget (each trains like any preset,
/// given the memory): `0.5b` Qwen2.5-0.5B, `1b` TinyLlama-1.1B (= `llama-1b`), `3b`
/// Llama-3.2-3B, `7b` and `13b` Llama-2, `34b` CodeLlama-34B, `70b` Llama-2-70B. Each has its
/// model's vocabulary, grouped heads, tying and context length.
pub const SIZE_PRESETS: [&str; 7] = ["0.5b", "1b", "3b", "7b", "13b", "34b", "70b"];

impl LmConfig {
    /// A named size: `tiny` (~1M parameters, byte vocabulary), `small` (~10M), `gpt2-124m`
    /// (GPT-2 small's shape and vocabulary), `llama-1b` (TinyLlama's 1.1B shape), or one of
    /// the [`SIZE_PRESETS`].
    pub fn preset(name: &str) -> Result<Self, Error> {
        let config = match name {
            "tiny" => Self::new(256, 128, 5, 4, 4, 384, 256),
            "small" => Self::new(4096, 384, 6, 6, 2, 1024, 1024),
            "gpt2-124m" => {
                Self::new(50257, 768, 12, 12, 12, 3072, 1024).with_mlp(MlpKind::ReluSquared)
            }
            "llama-1b" | "1b" => {
                Self::new(32000, 2048, 22, 32, 4, 5632, 2048).with_tie_embeddings(false)
            }
            "0.5b" => Self::new(151936, 896, 24, 14, 2, 4864, 32768).with_rope_theta(1e6),
            "3b" => Self::new(128256, 3072, 28, 24, 8, 8192, 131072).with_rope_theta(5e5),
            "7b" => Self::new(32000, 4096, 32, 32, 32, 11008, 4096).with_tie_embeddings(false),
            "13b" => Self::new(32000, 5120, 40, 40, 40, 13824, 4096).with_tie_embeddings(false),
            "34b" => Self::new(32000, 8192, 48, 64, 8, 22016, 16384)
                .with_tie_embeddings(false)
                .with_rope_theta(1e6),
            "70b" => Self::new(32000, 8192, 80, 64, 8, 28672, 4096).with_tie_embeddings(false),
            _ => {
                return Err(Error::InvalidConfig(format!(
                    "unknown model `{name}`; expected one of {}, or a size: {}",
                    PRESETS.join(", "),
                    SIZE_PRESETS.join(", ")
                )));
            }
        };
        Ok(config)
    }

    /// Width of one attention head.
    pub fn d_head(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// How the MLP's node keeps its activations: [`Self::saved_precision`], but ReLU²'s
    /// `relu(u)` in 8 bits under `Int4`. Its weight's gradient reads the square of the rounded
    /// value, high by up to a quarter of the squared step per value: at 7 steps a row that is
    /// most values (the small ones), and tiny's validation loss +1.5% after 300 steps (three
    /// seeds; 8 bits +0.5%).
    pub(crate) fn mlp_precision(&self) -> SavedPrecision {
        match (self.mlp, self.saved_precision) {
            (MlpKind::ReluSquared, SavedPrecision::Int4) => SavedPrecision::Int8,
            (_, precision) => precision,
        }
    }

    /// How flash attention keeps its values: [`Self::saved_precision`], but 8 bits under
    /// `Int4`: 4-bit values cost tiny 1.3% of validation loss after 300 steps (three seeds; 8
    /// bits 0.2%), for 5–13% of the saved bytes.
    pub(crate) fn values_precision(&self) -> SavedPrecision {
        match self.saved_precision {
            SavedPrecision::Int4 => SavedPrecision::Int8,
            precision => precision,
        }
    }

    /// Checks that the shapes fit together, naming the first that does not.
    pub fn validate(&self) -> Result<(), Error> {
        let fail = |msg: String| Err(Error::InvalidConfig(msg));
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("d_ff", self.d_ff),
            ("max_seq_len", self.max_seq_len),
        ] {
            if value == 0 {
                return fail(format!("{name} must be positive"));
            }
        }
        if self.vocab_size < 2 {
            return fail(format!(
                "a vocabulary of {} token has nothing to predict: the loss is 0 from the start",
                self.vocab_size
            ));
        }
        if self.saved_precision != SavedPrecision::Full && self.savers != SaverKind::Exact {
            return fail(format!(
                "saved_precision = {:?} needs the saving ops (savers = Exact): Burn's autodiff \
                 keeps its activations in full",
                self.saved_precision
            ));
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return fail(format!(
                "n_heads = {} does not divide d_model = {}",
                self.n_heads, self.d_model
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return fail(format!(
                "n_kv_heads = {} does not divide n_heads = {}",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !self.d_head().is_multiple_of(2) {
            return fail(format!(
                "rotary embedding needs an even head width, got {}",
                self.d_head()
            ));
        }
        Ok(())
    }

    /// Exact number of weights of the model this config builds (trainable scalars; for counter
    /// codes, the weights they hold). Standard and reversible blocks have the same.
    pub fn param_count(&self) -> usize {
        let block: usize = self.block_weights().iter().map(BlockWeight::elements).sum();
        let head = match self.tie_embeddings {
            true => 0,
            false => self.vocab_size * self.d_model,
        };
        self.vocab_size * self.d_model + self.n_layers * block + self.d_model + head
    }

    /// The weights of one block, in the order its forward reads them: the attention's norm,
    /// query, key, value and output projections, the MLP's norm and matrices.
    pub(crate) fn block_weights(&self) -> Vec<BlockWeight> {
        let d = self.d_model;
        let kv = self.n_kv_heads * self.d_head();
        let norm = BlockWeight::Norm(d);
        let matrix = |d_out, d_in| BlockWeight::Matrix { d_out, d_in };
        let mlp = match self.mlp {
            MlpKind::SwiGlu => vec![
                matrix(self.d_ff, d),
                matrix(self.d_ff, d),
                matrix(d, self.d_ff),
            ],
            MlpKind::ReluSquared => vec![matrix(self.d_ff, d), matrix(d, self.d_ff)],
        };
        [
            norm,
            matrix(d, d),
            matrix(kv, d),
            matrix(kv, d),
            matrix(d, d),
            norm,
        ]
        .into_iter()
        .chain(mlp)
        .collect()
    }

    /// Weight matrices of one MLP: SwiGLU's gate, up and down, ReLU²'s up and down.
    pub fn mlp_matrices(&self) -> usize {
        match self.mlp {
            MlpKind::SwiGlu => 3,
            MlpKind::ReluSquared => 2,
        }
    }

    /// Linears of one block: the attention's four projections and the MLP's matrices.
    pub(crate) fn block_linears(&self) -> usize {
        4 + self.mlp_matrices()
    }
}

/// One weight of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockWeight {
    /// An RMSNorm's `[d]` scale.
    Norm(usize),
    /// A linear's `[d_out, d_in]` matrix.
    Matrix { d_out: usize, d_in: usize },
}

impl BlockWeight {
    pub(crate) fn elements(&self) -> usize {
        match *self {
            Self::Norm(d) => d,
            Self::Matrix { d_out, d_in } => d_out * d_in,
        }
    }

    /// The scalars a LoRA adapter of `rank` trains on this weight: `A` `[d_in, rank]` and `B`
    /// `[rank, d_out]` on a matrix, none on a norm.
    pub(crate) fn adapter_elements(&self, rank: usize) -> usize {
        match *self {
            Self::Norm(_) => 0,
            Self::Matrix { d_out, d_in } => rank * (d_in + d_out),
        }
    }
}

/// `1234567` → `"1.23M"`, for printing parameter counts.
pub fn human_count(n: usize) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e9 => format!("{:.2}B", n / 1e9),
        n if n >= 1e6 => format!("{:.2}M", n / 1e6),
        n if n >= 1e3 => format!("{:.1}K", n / 1e3),
        n => format!("{n}"),
    }
}
