//! The Flex path: the tiled algorithm of `tiled.rs`, on Flex's tensors computed in f32.

use burn::backend::Flex;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::tensor::DType;

use super::tiled::{self, Tiles};
use super::{FlashAttentionBackend, FlashAttentionOptions};
use crate::ops::flex::{bool, float, primitive};

impl FlashAttentionBackend for Flex {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        masked: bool,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype();
        let mask = masked.then(|| bool(mask));
        let (out, lse) = tiled::forward(float(q), float(k), float(v), mask, options, Tiles::CACHE)
            .unwrap_or_else(|error| panic!("{error}"));
        // Cast where the output is contiguous, so that it keeps its query layout.
        let out = Self::float_swap_dims(primitive(out.swap_dims(1, 2), dtype), 1, 2);
        (out, primitive(lse, DType::F32))
    }

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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype();
        let (dq, dk, dv) = tiled::backward(
            float(q),
            float(k),
            float(v),
            masked.then(|| bool(mask)),
            float(out),
            float(lse),
            float(d_out),
            options,
            Tiles::CACHE,
        )
        .unwrap_or_else(|error| panic!("{error}"));
        (
            primitive(dq, dtype),
            primitive(dk, dtype),
            primitive(dv, dtype),
        )
    }
}
