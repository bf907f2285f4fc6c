//! Flash attention as one node with a handwritten backward, for the two paths that the backend
//! op does not take:
//! - [`flash_attention_saving_values`]: the backward keeps the values `v` in 8 or 4 bits. It
//!   reads `v` only in `dP = dO·vᵀ`, from which `dS = P ∘ (dP − rowsum(dO ∘ O))` gives `dq` and
//!   `dk`; `dv = Pᵀ·dO` does not read it. All of that is linear in `v`, so with stochastically
//!   rounded values (`E[Q(v)] = v`) `dq` and `dk` are unbiased and `dv` is exact.
//! - [`blockwise_attention`]: the tiled algorithm (`tiled.rs`) on the backend's own tensor ops
//!   and matmuls, in tiles of whole key rows within a byte budget.

use burn::backend::{Dispatch, DispatchTensor};
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::FloatDType;

use super::tiled::{self, Tiles};
use super::{FlashAttentionBackend, FlashAttentionOptions, flash_attention, prepared};
use crate::ops::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward_after_both,
};
use crate::ops::saved_rows::{SavedPrecision, SavedRows};

/// The score tile [`blockwise_attention`] takes by default: 64 MiB of f32 scores.
pub const DEFAULT_SCORE_TILE_BYTES: usize = 64 << 20;

/// Which computation runs the forward and the backward.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// The backend op: the CubeCL kernels on Cube, the tiled algorithm in cache-sized tiles on
    /// Flex.
    Backend,
    /// The tiled algorithm in these tiles, on the backend's tensor ops.
    Blockwise(Tiles),
}

/// [`flash_attention`] whose backward pass keeps `v` as `values` says: in full (then it is
/// [`flash_attention`]), or in 8 or 4 bits per value with one f32 scale per row of `d_v`
/// values, rounded stochastically ([`SavedPrecision`]). The forward pass is exact; the
/// backward's `dq` and `dk` are unbiased and `dv` is the exact one (see the module's docs).
///
/// # Shapes
/// As [`flash_attention`]'s.
///
/// # Panics
/// As [`flash_attention`].
pub fn flash_attention_saving_values(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
    values: SavedPrecision,
) -> Tensor<4> {
    if values == SavedPrecision::Full || !differentiated(&q, &k, &v) {
        return flash_attention(q, k, v, mask, options);
    }
    attend(q, k, v, mask, options, values, Path::Backend)
}

/// [`flash_attention`]'s function and gradients computed tile by tile with the backend's own
/// tensor ops and matmuls (autotuned on Cube devices), where the CubeCL kernels are not the
/// faster path: each tile holds the scores of whole rows of keys for as many query rows as fit
/// `score_tile_bytes` of f32 ([`DEFAULT_SCORE_TILE_BYTES`] is a fair default). Memory: the
/// forward holds a few such tiles at once and the backward about five (scores, probabilities,
/// their dropped and upstream forms, the score gradient), besides the inputs' size; never an
/// `[s_q, s_k]` matrix unless one tile covers it.
///
/// # Shapes
/// As [`flash_attention`]'s.
///
/// # Panics
/// As [`flash_attention`].
pub fn blockwise_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
    score_tile_bytes: usize,
) -> Tensor<4> {
    let tiles = Tiles::whole_keys(&q, &k, score_tile_bytes);
    if !differentiated(&q, &k, &v) {
        let (mask, masked, options) =
            prepared(&q, &k, &v, mask, options).unwrap_or_else(|error| panic!("{error}"));
        return blockwise_forward(q, k, v, masked.then_some(mask), options, tiles).0;
    }
    attend(
        q,
        k,
        v,
        mask,
        options,
        SavedPrecision::Full,
        Path::Blockwise(tiles),
    )
}

/// Whether a gradient is asked of q, k or v.
fn differentiated(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) -> bool {
    q.is_autodiff() && [q, k, v].iter().any(|t| t.is_tracked())
}

/// Attention computed outside the graph by `path`, attached to q, k and v with the backward of
/// `path`, keeping `v` at `values`.
fn attend(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
    values: SavedPrecision,
    path: Path,
) -> Tensor<4> {
    let (mask, masked, options) =
        prepared(&q, &k, &v, mask, options).unwrap_or_else(|error| panic!("{error}"));
    let (inner_q, inner_k, inner_v) = (q.clone().inner(), k.clone().inner(), v.clone().inner());
    let mask = mask.inner();
    let (out, lse) = match path {
        Path::Backend => {
            let (out, lse) = Dispatch::flash_attention_forward(
                inner_q.clone().into_dispatch(),
                inner_k.clone().into_dispatch(),
                inner_v.clone().into_dispatch(),
                mask.clone().into_dispatch(),
                masked,
                options,
            );
            (Tensor::<4>::from_dispatch(out), Tensor::from_dispatch(lse))
        }
        Path::Blockwise(tiles) => blockwise_forward(
            inner_q.clone(),
            inner_k.clone(),
            inner_v.clone(),
            masked.then(|| mask.clone()),
            options,
            tiles,
        ),
    };
    let value_dims = v.dims();
    let [.., d_v] = value_dims;
    let rows = value_dims[..3].iter().product();
    let (k_key, v_key) = (
        k.is_tracked().then(ParamId::new),
        v.is_tracked().then(ParamId::new),
    );
    let others = [
        k_key.map(|key| (key, k.clone().into_dispatch())),
        v_key.map(|key| (key, v.clone().into_dispatch())),
    ]
    .into_iter()
    .flatten()
    .collect();
    let backward = AttentionBackward {
        q: inner_q,
        k: inner_k,
        v: SavedRows::new(inner_v.reshape([rows, d_v]), values),
        value_dims,
        mask,
        masked,
        out: out.clone(),
        lse,
        options,
        path,
        k_key,
        v_key,
    };
    // k and v are parents too, so that autodiff reaches their projections' backwards after
    // this node has handed over their gradients.
    attach_backward_after_both(
        q,
        k,
        v,
        Tensor::from_inner(out),
        BackwardContext::new(Box::new(backward), others),
    )
}

/// The tiled forward on f32 copies of half-precision inputs (as the kernels widen each element):
/// the output in q's dtype and the log-sum-exp in f32.
fn blockwise_forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
    tiles: Tiles,
) -> (Tensor<4>, Tensor<4>) {
    let dtype = q.dtype();
    let (out, lse) = tiled::forward(
        q.cast(FloatDType::F32),
        k.cast(FloatDType::F32),
        v.cast(FloatDType::F32),
        mask,
        options,
        tiles,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    (out.cast(dtype), lse)
}

/// FlashAttention-2's backward by `path`, reading `v` as it was kept.
#[derive(Debug)]
struct AttentionBackward {
    /// Outside the graph, as the forward read them.
    q: Tensor<4>,
    k: Tensor<4>,
    /// `v` as `[batch · kv_heads · s_k, d_v]`.
    v: SavedRows,
    value_dims: [usize; 4],
    mask: Tensor<3, Bool>,
    masked: bool,
    out: Tensor<4>,
    lse: Tensor<4>,
    options: FlashAttentionOptions,
    path: Path,
    k_key: Option<ParamId>,
    v_key: Option<ParamId>,
}

impl HandwrittenBackward for AttentionBackward {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let AttentionBackward {
            q,
            k,
            v,
            value_dims,
            mask,
            masked,
            out,
            lse,
            options,
            path,
            k_key,
            v_key,
        } = *self;
        let v = v.restore().reshape(value_dims);
        let (dq, dk, dv) = match path {
            Path::Backend => Dispatch::flash_attention_backward(
                q.into_dispatch(),
                k.into_dispatch(),
                v.into_dispatch(),
                mask.into_dispatch(),
                masked,
                out.into_dispatch(),
                lse.into_dispatch(),
                output_gradient,
                options,
            ),
            Path::Blockwise(tiles) => {
                let dtypes = [q.dtype(), k.dtype(), v.dtype()];
                let (dq, dk, dv) = tiled::backward(
                    q.cast(FloatDType::F32),
                    k.cast(FloatDType::F32),
                    v.cast(FloatDType::F32),
                    masked.then_some(mask),
                    out.cast(FloatDType::F32),
                    lse,
                    Tensor::<4>::from_dispatch(output_gradient).cast(FloatDType::F32),
                    options,
                    tiles,
                )
                .unwrap_or_else(|error| panic!("{error}"));
                let [dq, dk, dv] = [dq, dk, dv]
                    .into_iter()
                    .zip(dtypes)
                    .map(|(gradient, dtype)| gradient.cast(dtype).into_dispatch())
                    .collect::<Vec<_>>()
                    .try_into()
                    .expect("three gradients");
                (dq, dk, dv)
            }
        };
        for (key, gradient) in [(k_key, dk), (v_key, dv)] {
            if let Some(key) = key {
                param_gradient(key, gradient);
            }
        }
        dq
    }
}
