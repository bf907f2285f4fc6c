//! Fused linear + cross-entropy: the loss of an LM head without its `[tokens, vocab]` logits.
//!
//! The op walks the tokens in chunks. For each chunk it computes the chunk's logits
//! `[chunk, vocab]` with one matmul, reduces each row to its loss and log-sum-exp, and turns the
//! logits into their gradient in place; two more matmuls add the chunk's share of `d_hidden` and
//! `d_weight`. Only one chunk of logits is alive at a time and the chunk has a fixed number of
//! tokens: the peak grows with `vocab × d` (the weight's gradient) and `chunk × vocab`, and
//! with the number of tokens only through `[tokens, d]` tensors, never through `tokens × vocab`.
//! The vocabulary is not tiled: a whole row of logits is one matmul's output, and its
//! log-sum-exp and gradient come from two passes over it (tiling would need a second matmul
//! per tile to recompute the logits once the row's log-sum-exp is known).
//!
//! By default the gradients are computed during the forward pass, as Liger-Kernel does (three
//! matmuls per chunk), and the backward pass only scales them by the upstream gradient. The
//! alternative, Cut Cross-Entropy's, saves one log-sum-exp per token and recomputes the logits
//! in the backward pass (four matmuls). Both hold the same tensors when the backward pass
//! begins, so they have the same peak; the first is faster (docs/BENCHMARKS.md). A loss with
//! `Reduction::None` needs a gradient per token from upstream and therefore always recomputes.
//!
//! - `chunked.rs`: the chunk loop on any backend's primitives (matmuls are the backend's own);
//! - `flex.rs`: loss, log-sum-exp and gradient of rows of logits on the host (the Flex path);
//! - `cube.rs`: the same rows as CubeCL kernels (every Cube runtime);
//! - `autodiff.rs`: the handwritten backward wired into Burn's autodiff.

mod autodiff;
pub(crate) mod choices;
mod chunked;
#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;

use choices::{GradientPass, Reduction};

/// Tokens per chunk when [`FusedCrossEntropyOptions::chunk_size`] is `None`. Every chunk adds
/// its share to `d_weight`, a pass over `vocab × d` that a chunk of `c` tokens amortises over
/// `c·vocab·d` multiply-adds. Measured at vocab 128256, 1024 tokens on Flex: 65-token chunks
/// took 8.98 s, 256-token chunks 4.75 s, 1024-token chunks 3.79 s for a 1.15× higher peak
/// (docs/BENCHMARKS.md).
pub const DEFAULT_CHUNK_TOKENS: usize = 256;

/// The most logits a default chunk holds (`chunk × vocab`): 128 MiB of f32, so a huge
/// vocabulary gets fewer tokens per chunk rather than a larger buffer.
pub const MAX_CHUNK_LOGITS: usize = 1 << 25;

/// The most tokens in one chunk: one cube per token row, within every runtime's grid.
const MAX_CHUNK_TOKENS: usize = 65535;

/// The fewest tokens in a default chunk, whatever the vocabulary: fewer would leave the
/// chunk's matmuls too few output tiles to fill a GPU, and repeat the pass over `vocab × d`
/// that each chunk's weight-gradient share costs too often.
pub const MIN_CHUNK_TOKENS: usize = 128;

/// The vocabulary a slice of the hidden gradient's product covers at least, by default: the
/// product `∂loss/∂logits [chunk, vocab] · weight [vocab, d]` has only `chunk × d` outputs and
/// a reduction over the whole vocabulary, which a GPU runs on too few cubes unless the
/// vocabulary is split into slices whose products run side by side (split-K) and are summed.
pub const VOCAB_PER_SLICE: usize = 4096;

/// What the loss is and how it is computed. The defaults are plain mean cross-entropy.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct FusedCrossEntropyOptions {
    /// Tokens with this target add nothing to the loss or the gradients, and cost no compute.
    pub ignore_index: Option<usize>,
    /// How the per-token losses become the output.
    pub reduction: Reduction,
    /// `ε`: the target distribution is `(1 − ε)·one_hot + ε / vocab` (as Burn's and PyTorch's).
    pub label_smoothing: f64,
    /// `λ` of the z-loss `λ·lse²` added per token (PaLM), which keeps the log-partition near 0.
    pub z_loss: f64,
    /// Logit soft-capping `c · tanh(z / c)` (Gemma 2), applied before the softmax.
    pub softcap: Option<f64>,
    /// Tokens per chunk; `None` picks [`DEFAULT_CHUNK_TOKENS`], fewer when `chunk × vocab` would
    /// pass [`MAX_CHUNK_LOGITS`], but not fewer than [`MIN_CHUNK_TOKENS`].
    pub chunk_size: Option<usize>,
    /// Slices of the vocabulary the hidden gradient's product is split into (split-K), each a
    /// batch of one batched matmul, their products summed; it must divide the vocabulary.
    /// `None` picks [`FusedCrossEntropyOptions::vocab_slices`]'s default.
    pub vocab_slices: Option<usize>,
    /// When the gradients of a reduced loss are computed.
    pub gradients: GradientPass,
}

impl FusedCrossEntropyOptions {
    /// Tokens per chunk for a vocabulary of `vocab`: the [`chunk_size`](Self::chunk_size) asked
    /// for, or the default.
    pub fn chunk_tokens(&self, vocab: usize) -> usize {
        self.chunk_size
            .unwrap_or(
                DEFAULT_CHUNK_TOKENS
                    .min(MAX_CHUNK_LOGITS / vocab.max(1))
                    .max(MIN_CHUNK_TOKENS),
            )
            .clamp(1, MAX_CHUNK_TOKENS)
    }

    /// Slices of the vocabulary for the hidden gradient's product with chunks of `chunk`
    /// tokens: the [`vocab_slices`](Self::vocab_slices) asked for, or the most slices of at
    /// least [`VOCAB_PER_SLICE`] that divide `vocab` and whose `slices × chunk × d` partial
    /// products hold no more than one `vocab × d` weight-gradient share (so that they never
    /// raise the loss's peak, which that share sets).
    pub fn vocab_slices(&self, vocab: usize, chunk: usize) -> usize {
        self.vocab_slices.unwrap_or_else(|| {
            let most = (vocab / VOCAB_PER_SLICE).min(vocab / chunk.max(1)).max(1);
            (1..=most)
                .rev()
                .find(|&slices| vocab.is_multiple_of(slices))
                .unwrap_or(1)
        })
    }
}

/// The side of a square output tile of a GPU matmul (cubek's and most others' common tile), for
/// counting how many tiles, and so how many cubes, a product gives a GPU.
pub const MATMUL_TILE: usize = 64;

/// How the loss walks the tokens: its chunks, and the output tiles of each chunk's three
/// products (`MATMUL_TILE`² each), which tell how well they fill a GPU; and the passes over a
/// `[vocab, d]` buffer that adding each chunk's weight-gradient share costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Tokens per chunk.
    pub chunk_tokens: usize,
    /// Chunks of the kept tokens.
    pub chunks: usize,
    /// Slices of the vocabulary in the hidden gradient's product.
    pub vocab_slices: usize,
    /// Output tiles of a chunk's logits `[chunk, vocab]`.
    pub logits_tiles: usize,
    /// Output tiles of a chunk's hidden-gradient product, `[slices, chunk, d]`.
    pub hidden_grad_tiles: usize,
    /// Output tiles of a chunk's weight-gradient share `[vocab, d]`.
    pub weight_grad_tiles: usize,
    /// Shares added to the running weight gradient (every chunk after the first).
    pub weight_grad_adds: usize,
}

impl FusedCrossEntropyOptions {
    /// The chunk plan of a loss over `tokens` kept tokens with a `[vocab, d]` head.
    pub fn chunk_plan(&self, tokens: usize, vocab: usize, d: usize) -> ChunkPlan {
        let chunk = self.chunk_tokens(vocab).min(tokens.max(1));
        let slices = self.vocab_slices(vocab, chunk);
        let tiles =
            |rows: usize, cols: usize| rows.div_ceil(MATMUL_TILE) * cols.div_ceil(MATMUL_TILE);
        let chunks = tokens.div_ceil(chunk);
        ChunkPlan {
            chunk_tokens: chunk,
            chunks,
            vocab_slices: slices,
            logits_tiles: tiles(chunk, vocab),
            hidden_grad_tiles: slices * tiles(chunk, d),
            weight_grad_tiles: tiles(vocab, d),
            weight_grad_adds: chunks.saturating_sub(1),
        }
    }
}

/// The loss terms of one row of logits, as the row primitives of
/// [`FusedLinearCrossEntropyBackend`] take them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowLoss {
    /// `ε` of the label smoothing.
    pub label_smoothing: f32,
    /// `λ` of the z-loss.
    pub z_loss: f32,
    /// The soft-cap `c`, if any.
    pub softcap: Option<f32>,
}

/// Everything the backend op needs besides its tensors; built by
/// [`try_fused_linear_cross_entropy`] from the options and the targets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossPlan {
    /// The loss terms of a row.
    pub row_loss: RowLoss,
    /// How the per-token losses become the output.
    pub reduction: Reduction,
    /// When the gradients are computed (always `Recompute` for `Reduction::None`).
    pub gradients: GradientPass,
    /// Tokens in, and tokens that are not ignored (`kept ≤ tokens`).
    pub tokens: usize,
    /// Tokens that are not ignored.
    pub kept: usize,
    /// Tokens per chunk.
    pub chunk: usize,
    /// Slices of the vocabulary in the hidden gradient's product (1: one matmul).
    pub vocab_slices: usize,
    /// Whether the op's `bias` is real or a placeholder (an optional tensor cannot cross the
    /// backend-extension boundary).
    pub has_bias: bool,
}

/// Inputs or options that cannot make a loss, with what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FusedCrossEntropyError {
    /// `hidden` `[tokens, d]` and `weight` `[vocab, d]` disagree on `d`.
    #[error(
        "fused linear cross-entropy: hidden {hidden:?} and weight {weight:?} must share their \
         last dimension (weight is [vocab, d])"
    )]
    Width {
        /// `hidden`'s shape.
        hidden: Vec<usize>,
        /// `weight`'s shape.
        weight: Vec<usize>,
    },
    /// The bias is not `[vocab]`.
    #[error("fused linear cross-entropy: bias {bias:?} must be [vocab] = [{vocab}]")]
    Bias {
        /// The bias's shape.
        bias: Vec<usize>,
        /// The weight's rows.
        vocab: usize,
    },
    /// The targets are not one per token of `hidden` (`[..., d]` hidden states against `[...]`
    /// targets).
    #[error(
        "fused linear cross-entropy: targets {targets:?} must be hidden {hidden:?} without its \
         last dimension (one target per token)"
    )]
    Targets {
        /// The targets' shape.
        targets: Vec<usize>,
        /// `hidden`'s shape.
        hidden: Vec<usize>,
    },
    /// No token or no vocabulary.
    #[error(
        "fused linear cross-entropy: no tokens or no vocabulary (hidden {hidden:?}, weight \
         {weight:?})"
    )]
    Empty {
        /// `hidden`'s shape.
        hidden: Vec<usize>,
        /// `weight`'s shape.
        weight: Vec<usize>,
    },
    /// A target outside the vocabulary that is not `ignore_index`.
    #[error(
        "fused linear cross-entropy: target {target} of token {token} is outside [0, {vocab}){}",
        ignore_index.map_or(String::new(), |i| format!(" and is not ignore_index {i}"))
    )]
    TargetOutOfRange {
        /// The target.
        target: i64,
        /// Its token, counted over the flattened targets.
        token: usize,
        /// The vocabulary size.
        vocab: usize,
        /// The ignored target, if any.
        ignore_index: Option<usize>,
    },
    /// An option out of its range: its name, its value and the range.
    #[error("fused linear cross-entropy: {option} {value} must be {range}")]
    Option {
        /// The option's field in [`FusedCrossEntropyOptions`].
        option: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        range: &'static str,
    },
    /// An option that this head does not implement.
    #[error("fused linear cross-entropy: {head} takes no {option}")]
    Unsupported {
        /// The head.
        head: &'static str,
        /// The option it refuses.
        option: &'static str,
    },
}

impl FusedCrossEntropyOptions {
    /// The loss terms of a row, after checking each option's range.
    pub(crate) fn row_loss(&self) -> Result<RowLoss, FusedCrossEntropyError> {
        let refuse = |option, value, range| {
            Err(FusedCrossEntropyError::Option {
                option,
                value,
                range,
            })
        };
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return refuse("label_smoothing", self.label_smoothing, "in [0, 1]");
        }
        if !(self.z_loss >= 0.0 && self.z_loss.is_finite()) {
            return refuse("z_loss", self.z_loss, "finite and ≥ 0");
        }
        if let Some(cap) = self.softcap
            && !(cap > 0.0 && cap.is_finite())
        {
            return refuse("softcap", cap, "finite and > 0");
        }
        if self.chunk_size == Some(0) {
            return refuse("chunk_size", 0.0, "at least 1");
        }
        if self.vocab_slices == Some(0) {
            return refuse("vocab_slices", 0.0, "at least 1");
        }
        Ok(RowLoss {
            label_smoothing: self.label_smoothing as f32,
            z_loss: self.z_loss as f32,
            softcap: self.softcap.map(|cap| cap as f32),
        })
    }
}

/// Mean (or summed, or per-token) cross-entropy of `hidden · weightᵀ + bias` against `targets`,
/// computed chunk by chunk without materialising the logits. `hidden` is `[tokens, d]`,
/// `weight` `[vocab, d]` (a `Linear`'s weight transposed, or a tied embedding table), `bias`
/// `[vocab]` and `targets` `[tokens]`. Differentiable in `hidden`, `weight` and `bias`.
///
/// Reads the targets back to the host once (a device sync) to check them and to drop ignored
/// tokens before any compute. When every token is ignored the loss is 0 and every gradient is
/// zero, never NaN.
///
/// # Shapes
/// - `hidden`: `[tokens, d]`
/// - `weight`: `[vocab, d]`
/// - `bias`: `[vocab]`
/// - `targets`: `[tokens]`, each in `0..vocab` or `options.ignore_index`
/// - output: `[1]`, or `[tokens]` for `Reduction::None`
///
/// # Errors
/// A [`FusedCrossEntropyError`] naming the shape, target or option that does not fit.
pub fn try_fused_linear_cross_entropy(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    options: FusedCrossEntropyOptions,
) -> Result<Tensor<1>, FusedCrossEntropyError> {
    let row_loss = options.row_loss()?;
    fused_loss(hidden, weight, bias, targets, &options, row_loss)
}

/// [`try_fused_linear_cross_entropy`] with options already checked into `row_loss`.
pub(crate) fn fused_loss(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    options: &FusedCrossEntropyOptions,
    row_loss: RowLoss,
) -> Result<Tensor<1>, FusedCrossEntropyError> {
    check_shapes(
        hidden.dims(),
        weight.dims(),
        bias.as_ref().map(Tensor::dims),
        targets.dims(),
    )?;
    let ([tokens, _], [vocab, _]) = (hidden.dims(), weight.dims());
    let chunk = options.chunk_tokens(vocab);
    let vocab_slices = options.vocab_slices(vocab, chunk);
    if !vocab.is_multiple_of(vocab_slices) {
        return Err(FusedCrossEntropyError::Option {
            option: "vocab_slices",
            value: vocab_slices as f64,
            range: "a divisor of the vocabulary",
        });
    }

    let (rows, kept_targets) = kept_rows(&targets, vocab, options.ignore_index)?;
    let kept = rows.len();
    let device = hidden.device();
    // An empty index tensor is not something every runtime can allocate; the op reads `kept`.
    let upload = |values: Vec<i64>| {
        let values = if values.is_empty() { vec![0] } else { values };
        let len = values.len();
        Tensor::<1, Int>::from_data(TensorData::new(values, [len]), &device)
    };
    let plan = LossPlan {
        row_loss,
        reduction: options.reduction,
        gradients: match options.reduction {
            Reduction::None => GradientPass::Recompute,
            _ => options.gradients,
        },
        tokens,
        kept,
        chunk,
        vocab_slices,
        has_bias: bias.is_some(),
    };
    let bias = bias.unwrap_or_else(|| Tensor::zeros([1], &device));
    Ok(Tensor::from_dispatch(Dispatch::fused_linear_cross_entropy(
        hidden.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        upload(rows).into_dispatch(),
        upload(kept_targets).into_dispatch(),
        plan,
    )))
}

/// Checks `hidden` `[tokens ≥ 1, d]`, a head's `weight` `[vocab ≥ 1, d]` and `bias` `[vocab]`,
/// and `targets` `[tokens]`: the shapes of every head's loss, dense or coded.
pub(crate) fn check_shapes(
    hidden: [usize; 2],
    weight: [usize; 2],
    bias: Option<[usize; 1]>,
    targets: [usize; 1],
) -> Result<(), FusedCrossEntropyError> {
    let ([tokens, d], [vocab, d_weight]) = (hidden, weight);
    if d != d_weight {
        return Err(FusedCrossEntropyError::Width {
            hidden: hidden.to_vec(),
            weight: weight.to_vec(),
        });
    }
    if let Some(bias) = bias
        && bias != [vocab]
    {
        return Err(FusedCrossEntropyError::Bias {
            bias: bias.to_vec(),
            vocab,
        });
    }
    if targets != [tokens] {
        return Err(FusedCrossEntropyError::Targets {
            targets: targets.to_vec(),
            hidden: hidden.to_vec(),
        });
    }
    if tokens == 0 || vocab == 0 {
        return Err(FusedCrossEntropyError::Empty {
            hidden: hidden.to_vec(),
            weight: weight.to_vec(),
        });
    }
    Ok(())
}

/// [`try_fused_linear_cross_entropy`] for inputs known to fit.
///
/// # Panics
/// With the [`FusedCrossEntropyError`]'s message, on inputs or options that cannot make a loss.
pub fn fused_linear_cross_entropy(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    options: FusedCrossEntropyOptions,
) -> Tensor<1> {
    try_fused_linear_cross_entropy(hidden, weight, bias, targets, options)
        .unwrap_or_else(|error| panic!("{error}"))
}

/// The rows whose target is not `ignore_index`, and their targets, after checking every target
/// against the vocabulary.
pub(crate) fn kept_rows(
    targets: &Tensor<1, Int>,
    vocab: usize,
    ignore_index: Option<usize>,
) -> Result<(Vec<i64>, Vec<i64>), FusedCrossEntropyError> {
    let ignored = ignore_index.map(|i| i as i64);
    let mut rows = Vec::new();
    let mut kept = Vec::new();
    let data = targets.to_data().convert::<i64>();
    for (row, &target) in data
        .as_slice::<i64>()
        .expect("converted to i64")
        .iter()
        .enumerate()
    {
        if Some(target) == ignored {
            continue;
        }
        if !(0..vocab as i64).contains(&target) {
            return Err(FusedCrossEntropyError::TargetOutOfRange {
                target,
                token: row,
                vocab,
                ignore_index,
            });
        }
        rows.push(row as i64);
        kept.push(target);
    }
    Ok((rows, kept))
}

/// The backend extension behind [`fused_linear_cross_entropy`]. The op itself is the chunk loop
/// of `chunked.rs` on any backend's own matmuls; each backend brings the two row primitives
/// (Flex on the host in `flex.rs`, Cube as kernels in `cube.rs`), and Autodiff the
/// handwritten backward.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff, Fusion: cfg(feature = "cube"))]
pub trait FusedLinearCrossEntropyBackend: Backend {
    /// The loss of the `plan.kept` tokens `rows` of `hidden` `[tokens, d]` against `targets`
    /// (`[max(kept, 1)]` each): `[1]`, or `[tokens]` for `Reduction::None`. `bias` is read only
    /// when `plan.has_bias`.
    #[fusion(default)]
    fn fused_linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        rows: IntTensor<Self>,
        targets: IntTensor<Self>,
        plan: LossPlan,
    ) -> FloatTensor<Self> {
        let inputs = chunked::Inputs {
            hidden,
            weight,
            bias: plan.has_bias.then_some(bias),
            rows,
            targets,
        };
        chunked::loss::<Self>(&inputs, &plan).0
    }

    /// Loss `[rows]` and log-sum-exp `[rows]` (f32) of each row of `logits` `[rows, vocab]`.
    #[fusion(meta = cube::rows_forward_spec)]
    fn cross_entropy_rows_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        row_loss: RowLoss,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `∂loss/∂logits` `[rows, vocab]` (in `logits`' dtype, reusing its memory when it can),
    /// each row scaled by `d_loss` `[rows]` (f32).
    #[fusion(meta = cube::rows_backward_spec)]
    fn cross_entropy_rows_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        d_loss: FloatTensor<Self>,
        row_loss: RowLoss,
    ) -> FloatTensor<Self>;
}
