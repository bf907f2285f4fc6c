//! Flash attention whose backward pass keeps the values `v` in 8 or 4 bits.
//!
//! The backward reads `v` only in `dP = dO·vᵀ`, from which `dS = P ∘ (dP − rowsum(dO ∘ O))`
//! gives `dq` and `dk`; `dv = Pᵀ·dO` does not read it. All of that is linear in `v`, so with
//! stochastically rounded values (`E[Q(v)] = v`) `dq` and `dk` are unbiased and `dv` is exact.

use burn::backend::{Dispatch, DispatchTensor};
use burn::module::ParamId;
use burn::prelude::*;

use super::{FlashAttentionBackend, FlashAttentionOptions, flash_attention, prepared};
use crate::ops::handwritten_backward::{
    BackwardContext, HandwrittenBackward, attach_backward_after_both,
};
use crate::ops::saved_rows::{SavedPrecision, SavedRows};

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
    let tracked = [q.is_tracked(), k.is_tracked(), v.is_tracked()];
    if values == SavedPrecision::Full || !(q.is_autodiff() && tracked.contains(&true)) {
        return flash_attention(q, k, v, mask, options);
    }
    let (mask, masked, options) =
        prepared(&q, &k, &v, mask, options).unwrap_or_else(|error| panic!("{error}"));
    let (inner_q, inner_k, inner_v) = (q.clone().inner(), k.clone().inner(), v.clone().inner());
    let mask = mask.inner();
    let (out, lse) = Dispatch::flash_attention_forward(
        inner_q.clone().into_dispatch(),
        inner_k.clone().into_dispatch(),
        inner_v.clone().into_dispatch(),
        mask.clone().into_dispatch(),
        masked,
        options,
    );
    let out = Tensor::<4>::from_dispatch(out);
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
    let backward = SavedValuesBackward {
        q: inner_q,
        k: inner_k,
        v: SavedRows::new(inner_v.reshape([rows, d_v]), values),
        value_dims,
        mask,
        masked,
        out: out.clone(),
        lse: Tensor::from_dispatch(lse),
        options,
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

/// The backward of [`flash_attention_saving_values`]: FlashAttention-2's, reading `Q(v)`.
#[derive(Debug)]
struct SavedValuesBackward {
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
    k_key: Option<ParamId>,
    v_key: Option<ParamId>,
}

impl HandwrittenBackward for SavedValuesBackward {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let SavedValuesBackward {
            q,
            k,
            v,
            value_dims,
            mask,
            masked,
            out,
            lse,
            options,
            k_key,
            v_key,
        } = *self;
        let (dq, dk, dv) = Dispatch::flash_attention_backward(
            q.into_dispatch(),
            k.into_dispatch(),
            v.restore().reshape(value_dims).into_dispatch(),
            mask.into_dispatch(),
            masked,
            out.into_dispatch(),
            lse.into_dispatch(),
            output_gradient,
            options,
        );
        for (key, gradient) in [(k_key, dk), (v_key, dv)] {
            if let Some(key) = key {
                param_gradient(key, gradient);
            }
        }
        dq
    }
}
