//! Flash attention: exact `softmax(QKᵀ·scale + mask) V` that never holds an `[s_q, s_k]` matrix,
//! in the forward pass or the backward.
//!
//! The forward pass walks key tiles with an online softmax and saves, besides the output, one
//! log-sum-exp per query row. The backward pass (FlashAttention-2) recomputes each tile's
//! probabilities from that log-sum-exp. Training memory therefore grows linearly with the
//! sequence, where Burn's autodiff attention keeps `[batch, heads, s_q, s_k]` scores and
//! probabilities.
//!
//! - `tiled.rs`: the algorithm on Burn tensors, tile by tile (the Flex path, and the oracle the
//!   kernels are checked against);
//! - `cube.rs`: the CubeCL kernels of `burn-memwall-kernels` (every Cube runtime);
//! - `autodiff.rs`: the handwritten backward wired into Burn's autodiff.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod tiled;

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::prelude::*;
use burn::tensor::DType;

use super::flex::{bool, float, primitive};

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
}

/// Shapes or options that cannot be attended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("flash attention: {0}")]
pub struct FlashAttentionError(String);

/// Checks q `[batch, heads, s_q, d]`, k `[batch, kv_heads, s_k, d]`, v `[batch, kv_heads, s_k, d_v]`,
/// the key padding mask `[batch, s_k]` and the options, naming the shapes that do not fit.
pub fn check_shapes(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    key_padding_mask: Option<&Tensor<2, Bool>>,
    options: &FlashAttentionOptions,
) -> Result<(), FlashAttentionError> {
    tiled::dims(q, k, v, key_padding_mask, options).map(|_| ())
}

/// Attention output `[batch, heads, s_q, d_v]` of q `[batch, heads, s_q, d]` over k
/// `[batch, kv_heads, s_k, d]` and v `[batch, kv_heads, s_k, d_v]` (grouped-query when
/// `kv_heads < heads`). `key_padding_mask` `[batch, s_k]` is true for keys to ignore; a query that
/// sees no key outputs zeros. Differentiable in q, k and v with a memory-lean backward.
///
/// Panics with a message naming the shapes when they do not fit (see [`check_shapes`]).
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_padding_mask: Option<Tensor<2, Bool>>,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    if let Err(error) = check_shapes(&q, &k, &v, key_padding_mask.as_ref(), &options) {
        panic!("{error}");
    }
    let [batch, _, s_k, _] = k.dims();
    let mask = key_padding_mask.unwrap_or_else(|| {
        Tensor::from_data(
            TensorData::new(vec![false; batch * s_k], [batch, s_k]),
            &q.device(),
        )
    });
    Tensor::from_dispatch(Dispatch::flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask.into_dispatch(),
        options,
    ))
}

/// The backend extension behind [`flash_attention`]: a forward that also returns the log-sum-exp
/// `[batch, heads, s_q, 1]` of every query row, and the backward that recomputes probabilities
/// from it. Flex runs the tiled algorithm (`tiled.rs`), Cube the CubeCL kernels (`cube.rs`),
/// Autodiff wires them together (`autodiff.rs`).
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff, Fusion: cfg(feature = "cube"))]
pub trait FlashAttentionBackend: Backend {
    /// See [`flash_attention`]; `key_padding_mask` is always given (all false for none).
    #[fusion(default)]
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: BoolTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self> {
        Self::flash_attention_forward(q, k, v, key_padding_mask, options).0
    }

    /// The output and the log-sum-exp that [`FlashAttentionBackend::flash_attention_backward`]
    /// needs (a query that sees no key has zeros and a log-sum-exp that is never read).
    #[fusion(meta = cube::forward_spec)]
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: BoolTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dq, dk, dv)` from the inputs, the forward's output and log-sum-exp, and `d_out`.
    #[allow(clippy::too_many_arguments)]
    #[fusion(meta = cube::backward_spec)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: BoolTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl FlashAttentionBackend for Flex {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: BoolTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype();
        let (out, lse) = tiled::forward(
            float(q),
            float(k),
            float(v),
            Some(bool(key_padding_mask)),
            options,
        )
        .unwrap_or_else(|error| panic!("{error}"));
        (primitive(out, dtype), primitive(lse, DType::F32))
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: BoolTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype();
        let (dq, dk, dv) = tiled::backward(
            float(q),
            float(k),
            float(v),
            Some(bool(key_padding_mask)),
            float(out),
            float(lse),
            float(d_out),
            options,
        )
        .unwrap_or_else(|error| panic!("{error}"));
        (
            primitive(dq, dtype),
            primitive(dk, dtype),
            primitive(dv, dtype),
        )
    }
}
