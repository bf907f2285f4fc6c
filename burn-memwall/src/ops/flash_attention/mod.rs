//! Flash attention: exact `softmax(QKᵀ·scale + mask) V` that never holds an `[s_q, s_k]` matrix,
//! in the forward pass or the backward.
//!
//! The forward pass walks key tiles with an online softmax and saves, besides the output, one
//! log-sum-exp per query row. The backward pass (FlashAttention-2) recomputes each tile's
//! probabilities from that log-sum-exp. Training memory therefore grows linearly with the
//! sequence, where Burn's autodiff attention keeps `[batch, heads, s_q, s_k]` scores and
//! probabilities.
//!
//! - `tiled.rs`: the algorithm on Burn tensors, tile by tile, and the shape checks of every
//!   backend;
//! - `flex.rs`: the Flex path, `tiled.rs` on Flex's tensors;
//! - `cube.rs`: the CubeCL kernels of `burn-memwall-kernels` (every Cube runtime);
//! - `launch_plan.rs`: what those kernels ask of a device at given shapes ([`launch_plans`]);
//! - `autodiff.rs`: the handwritten backward wired into Burn's autodiff;
//! - `handwritten.rs`: the op as one node with a handwritten backward, for the backward that
//!   keeps `v` in 8 or 4 bits and for the blockwise path on the backend's own matmuls.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;
mod handwritten;
#[cfg(feature = "cube")]
mod launch_plan;
mod tiled;

pub use handwritten::{
    DEFAULT_SCORE_TILE_BYTES, blockwise_attention, flash_attention_saving_values,
};
#[cfg(feature = "cube")]
pub use launch_plan::{FlashLaunchPlans, LaunchPlan, Limits, PlanError, launch_plans};

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall_codes::dropout::DropoutDraw;

/// What to attend to and how.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct FlashAttentionOptions {
    /// Multiplies `QKᵀ`; `None` means `1/√d`.
    pub scale: Option<f64>,
    /// Query `i` sees keys `j ≤ i + (s_k − s_q)`: causal, aligned to the end as with a KV cache.
    pub causal: bool,
    /// Sliding window: query `i` sees only the last `w` keys up to its aligned position
    /// `i + (s_k − s_q)` (implies `causal`).
    pub window: Option<usize>,
    /// Logit soft-capping `c · tanh(s / c)`, applied after scaling.
    pub softcap: Option<f64>,
    /// Burn's quiet softmax (`burn::tensor::activation::quiet_softmax`):
    /// `exp(s_j) / (1 + Σ_k exp(s_k))`, which lets a row attend to nothing. A row that sees no
    /// key outputs zeros either way.
    pub quiet_softmax: bool,
    /// Dropout of the attention weights after the softmax, as Burn's `MultiHeadAttention`
    /// applies its `Dropout`; regenerated in the backward pass from its seed, never saved.
    pub dropout: Option<AttentionDropout>,
}

/// Attention dropout: each attention weight is zeroed with probability `prob` and the others
/// are multiplied by `1 / (1 − prob)`. Which weights are dropped is a pure function of
/// `(seed, batch, head, query, key)` ([`AttentionDropout::keeps`]), the same on every backend;
/// give each step (and each layer) its own seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    /// The probability of dropping a weight, in `[0, 1)`; 0 is no dropout.
    pub prob: f64,
    /// Chooses the weights dropped.
    pub seed: u64,
}

impl AttentionDropout {
    /// Dropout of probability `prob` with a seed drawn from `device`'s generator, the one
    /// Burn's own `Dropout` draws from (`Device::seed` makes it repeatable). Reads the seed back
    /// from the device: once per layer and forward.
    pub fn seeded_by(device: &Device, prob: f64) -> Self {
        // Four draws of 16 bits: an `Int` tensor may hold only an i32.
        let quarters = Tensor::<1, Int>::random([4], Distribution::Uniform(0.0, 65536.0), device);
        let seed = quarters
            .into_data()
            .iter::<i64>()
            .fold(0u64, |seed, quarter| {
                (seed << 16) | (quarter as u64 & 0xffff)
            });
        Self { prob, seed }
    }

    /// Whether the weight of key `key` for query `query` of head `head` of batch element
    /// `batch` is kept: the mask that [`flash_attention`] applies, for inspecting it or
    /// reproducing it elsewhere.
    pub fn keeps(&self, batch: usize, head: usize, query: usize, key: usize) -> bool {
        let draw = self.draw();
        let stream = draw.row_stream(batch as u32, head as u32, query as u32);
        draw.keeps(stream, key as u32)
    }

    fn draw(&self) -> DropoutDraw {
        DropoutDraw::new(self.prob, self.seed)
    }

    /// What a kept weight is multiplied by.
    fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.prob)) as f32
    }
}

/// The largest head dimension (of q and k, or of v) the kernels hold in registers.
pub const MAX_HEAD_DIM: usize = 256;

/// The shapes of q, k and v, as an error names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShapes {
    /// `[batch, heads, s_q, d]`.
    pub q: [usize; 4],
    /// `[batch, kv_heads, s_k, d]`.
    pub k: [usize; 4],
    /// `[batch, kv_heads, s_k, d_v]`.
    pub v: [usize; 4],
}

impl std::fmt::Display for AttentionShapes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "q {:?}, k {:?}, v {:?}", self.q, self.k, self.v)
    }
}

/// Shapes or options that cannot be attended.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FlashAttentionError {
    /// q, k and v differ in their batch size.
    #[error("flash attention: q, k and v must have the same batch size ({0})")]
    Batch(AttentionShapes),
    /// k and v differ in their heads or sequence length.
    #[error("flash attention: k and v must have the same heads and sequence length ({0})")]
    KeyValue(AttentionShapes),
    /// q and k differ in their head dimension.
    #[error("flash attention: q and k must have the same head dim ({0})")]
    HeadDim(AttentionShapes),
    /// The query heads are not a whole number of groups of key/value heads.
    #[error(
        "flash attention: query heads ({heads}) must be a multiple of key/value heads \
         ({kv_heads}) ({shapes})"
    )]
    Heads {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// All three shapes.
        shapes: AttentionShapes,
    },
    /// A head dimension above [`MAX_HEAD_DIM`].
    #[error("flash attention: head dims above {MAX_HEAD_DIM} are not supported ({0})")]
    HeadDimTooLarge(AttentionShapes),
    /// The mask is not `[batch, s_q, s_k]`, nor broadcastable to it along batch or queries.
    #[error(
        "flash attention: the mask must be [batch or 1, s_q or 1, s_k] with [batch, s_q, s_k] \
         = {expected:?}, got {mask:?}"
    )]
    Mask {
        /// `[batch, s_q, s_k]`.
        expected: [usize; 3],
        /// The mask's shape.
        mask: [usize; 3],
    },
    /// A sliding window of 0 keys.
    #[error("flash attention: a sliding window must hold at least one key")]
    EmptyWindow,
    /// A soft-cap that is not finite and positive (which would make every score NaN).
    #[error("flash attention: softcap must be finite and positive, got {0}")]
    Softcap(f64),
    /// A scale that is not finite.
    #[error("flash attention: scale must be finite, got {0}")]
    Scale(f64),
    /// A dropout probability outside `[0, 1)`.
    #[error("flash attention: the dropout probability must be in [0, 1), got {0}")]
    Dropout(f64),
}

/// Checks q `[batch, heads, s_q, d]`, k `[batch, kv_heads, s_k, d]`, v `[batch, kv_heads, s_k, d_v]`,
/// the mask `[batch or 1, s_q or 1, s_k]` and the options, naming the shapes that do not fit.
pub fn check_shapes(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: Option<&Tensor<3, Bool>>,
    options: &FlashAttentionOptions,
) -> Result<(), FlashAttentionError> {
    tiled::dims(q, k, v, mask, options).map(|_| ())
}

/// Whether `mask` `[batch or 1, s_q, s_k]` hides exactly what [`FlashAttentionOptions::causal`]
/// hides, in every batch element: query `i` sees keys `j ≤ i + (s_k − s_q)`. Burn's
/// `generate_autoregressive_mask` is such a mask. Attention given `causal` instead of the mask
/// reads nothing per element and skips the hidden half by position. Reads one bool back from the
/// device, so call it once per batch (a model's forward), not per layer.
pub fn is_causal_mask(mask: &Tensor<3, Bool>) -> bool {
    let [batch, s_q, s_k] = mask.dims();
    let causal = Tensor::<2, Bool>::tril_mask([s_q, s_k], s_k as i64 - s_q as i64, &mask.device())
        .unsqueeze_dim::<3>(0)
        .expand([batch, s_q, s_k]);
    mask.clone().equal(causal).all().into_scalar()
}

/// Attention of q over k and v (grouped-query when `kv_heads < heads`). `mask` is true where a
/// query must not see a key, Burn's convention: Burn's `mask_attn` `[batch, s_q, s_k]` as it is,
/// a key padding mask `[batch, s_k]` as `mask_pad.unsqueeze_dim(1)`, one mask for every batch
/// element as `[1, s_q, s_k]`. It combines with the positional options (`causal`, `window`),
/// which cost nothing to read: prefer them to a mask that only says the same ([`is_causal_mask`]
/// tells). A query that sees
/// no key outputs zeros. Key tiles that no query of a tile sees are skipped. Differentiable in
/// q, k and v with a memory-lean backward; the mask is read, never differentiated.
///
/// # Shapes
/// - `q`: `[batch, heads, s_q, d]`
/// - `k`: `[batch, kv_heads, s_k, d]`
/// - `v`: `[batch, kv_heads, s_k, d_v]`
/// - `mask`: `[batch, s_q, s_k]`, `[batch, 1, s_k]`, `[1, s_q, s_k]` or `[1, 1, s_k]`
/// - output: `[batch, heads, s_q, d_v]`, laid out `[batch, s_q, heads, d_v]` in memory (query
///   layout), so that merging the heads, `swap_dims(1, 2).reshape([batch, s_q, heads · d_v])`,
///   copies nothing: the output projection then keeps the buffer the backward keeps anyway.
///
/// # Panics
/// With the [`FlashAttentionError`]'s message when the shapes or options do not fit;
/// [`try_flash_attention`] returns the error instead.
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    try_flash_attention(q, k, v, mask, options).unwrap_or_else(|error| panic!("{error}"))
}

/// [`flash_attention`], returning shapes or options that do not fit as an error.
pub fn try_flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
) -> Result<Tensor<4>, FlashAttentionError> {
    let (mask, masked, options) = prepared(&q, &k, &v, mask, options)?;
    Ok(Tensor::from_dispatch(Dispatch::flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask.into_dispatch(),
        masked,
        options,
    )))
}

/// The checked call's mask, whether one was given, and options as [`FlashAttentionBackend`]
/// takes them: the mask always a tensor (`[1, 1, s_k]`, all false and never read, for none), a
/// dropout of 0 as none.
fn prepared(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
) -> Result<(Tensor<3, Bool>, bool, FlashAttentionOptions), FlashAttentionError> {
    check_shapes(q, k, v, mask.as_ref(), &options)?;
    // A dropout of 0 is no dropout, exactly and at no cost.
    let options = FlashAttentionOptions {
        dropout: options.dropout.filter(|dropout| dropout.prob > 0.0),
        ..options
    };
    let s_k = k.dims()[2];
    let masked = mask.is_some();
    let mask = mask.unwrap_or_else(|| {
        Tensor::from_data(TensorData::new(vec![false; s_k], [1, 1, s_k]), &q.device())
    });
    Ok((mask, masked, options))
}

/// The backend extension behind [`flash_attention`]: a forward that also returns the log-sum-exp
/// `[batch, heads, s_q, 1]` of every query row, and the backward that recomputes probabilities
/// from it. Flex runs the tiled algorithm (`tiled.rs`), Cube the CubeCL kernels (`cube.rs`),
/// Autodiff wires them together (`autodiff.rs`).
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff, Fusion: cfg(feature = "cube"))]
pub trait FlashAttentionBackend: Backend {
    /// See [`flash_attention`]. `mask` is always a tensor, read only when `masked` (a call
    /// without a mask passes an all-false `[1, 1, s_k]`, so that no kernel reads it).
    #[fusion(default)]
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        masked: bool,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self> {
        Self::flash_attention_forward(q, k, v, mask, masked, options).0
    }

    /// The output, in query layout (see [`flash_attention`]'s shapes), and the log-sum-exp that
    /// [`FlashAttentionBackend::flash_attention_backward`] needs (a query that sees no key has
    /// zeros and a log-sum-exp that is never read).
    #[fusion(meta = cube::forward_spec)]
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        masked: bool,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dq, dk, dv)` from the inputs, the forward's output and log-sum-exp, and `d_out`.
    #[allow(clippy::too_many_arguments)]
    #[fusion(meta = cube::backward_spec)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        masked: bool,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}
