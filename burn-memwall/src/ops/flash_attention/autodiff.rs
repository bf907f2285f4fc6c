//! The handwritten backward: save q, k, v, the output and one log-sum-exp per row; recompute
//! each score tile from them in backward.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Autodiff, AutodiffBackend};

use super::{FlashAttentionBackend, FlashAttentionOptions};

/// What the backward needs: inputs, output, log-sum-exp. Nothing of size `s_q × s_k`.
type Saved<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    BoolTensor<B>,
    bool,
    FloatTensor<B>,
    FloatTensor<B>,
    FlashAttentionOptions,
);

#[derive(Debug)]
struct FlashAttentionBackward;

impl<B: FlashAttentionBackend> Backward<B, 3> for FlashAttentionBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_out = grads.consume::<B>(&ops.node);
        let (q, k, v, mask, masked, out, lse, options) = ops.state;
        let (dq, dk, dv) =
            B::flash_attention_backward(q, k, v, mask, masked, out, lse, d_out, options);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        masked: bool,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self> {
        match FlashAttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
                let (out, lse) = B::flash_attention_forward(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    mask.clone(),
                    masked,
                    options,
                );
                prep.finish((q, k, v, mask, masked, out.clone(), lse, options), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::flash_attention(
                q.into_primitive(),
                k.into_primitive(),
                v.into_primitive(),
                mask,
                masked,
                options,
            )),
        }
    }

    /// Not differentiable: the primitives the differentiable op above is built from.
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        masked: bool,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = B::flash_attention_forward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            mask,
            masked,
            options,
        );
        (Self::from_inner(out), Self::from_inner(lse))
    }

    /// Not differentiable (no double backward).
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
        let (dq, dk, dv) = B::flash_attention_backward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            mask,
            masked,
            out.into_primitive(),
            lse.into_primitive(),
            d_out.into_primitive(),
            options,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }
}
