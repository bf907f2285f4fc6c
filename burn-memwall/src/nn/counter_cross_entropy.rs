//! The fused loss of an LM head whose weight is a [`CounterWeights`] code: the cross-entropy of
//! `hidden · Wᵀ` without the `[tokens, vocab]` logits and without a dense weight gradient.
//!
//! The vocabulary is walked in blocks of rows. The forward pass keeps a running maximum and sum
//! of exponentials per token (an online log-sum-exp) and reads each token's target logit from
//! its decoded target row, so it saves only the hidden states and one log-sum-exp per token.
//! The backward pass walks the blocks again: it recomputes a block's logits, turns them into
//! their gradient, adds the block's share of the hidden states' gradient, then forms the
//! block's weight gradient `[block, d]` and hands it to the counter update, which consumes it.
//! Each block is read before its own update, so the step sees the weights of the forward pass.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::{FloatDType, IndexingUpdateOp};

use super::CounterWeights;
use super::{PackedWeight, Reduction};
use crate::ops::fused_linear_cross_entropy::{
    FusedCrossEntropyError, FusedCrossEntropyOptions, check_shapes, kept_rows,
};
use crate::ops::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward};
use crate::optim::InBackward;

/// The most elements of a block's logits `[tokens, block]` and of its weight gradient
/// `[block, d]`: 1 MiB of f32 each. Measured at vocab 32000, d 2048, 512 tokens on Flex
/// (`benches/fused_linear_cross_entropy.rs`): 4.84 s and 17.3 MiB, against 4.35 s and 22.0 MiB
/// with 4 MiB blocks and 4.23 s and 44.0 MiB with 16 MiB blocks.
const BLOCK_ELEMENTS: usize = 1 << 18;

/// Mean (or summed) cross-entropy of `hidden · Wᵀ` (`hidden` `[tokens, d]`, `head` a
/// `[vocab, d]` code) against `targets` `[tokens]`. Under autodiff the backward pass gives
/// `hidden` its gradient and updates `head` (at the learning rate of `in_backward`'s running
/// step, if any). Of the options, `ignore_index` and the reduction (`Mean` or `Sum`) apply;
/// label smoothing, the z-loss, soft-capping and per-token losses are refused.
pub(super) fn counter_cross_entropy(
    hidden: Tensor<2>,
    head: &CounterWeights,
    targets: Tensor<1, Int>,
    options: &FusedCrossEntropyOptions,
    in_backward: Option<&InBackward>,
) -> Result<Tensor<1>, FusedCrossEntropyError> {
    let refuse = |option| {
        Err(FusedCrossEntropyError::Unsupported {
            head: "a counter head",
            option,
        })
    };
    if options.label_smoothing != 0.0 {
        return refuse("label smoothing");
    }
    if options.z_loss != 0.0 {
        return refuse("z-loss");
    }
    if options.softcap.is_some() {
        return refuse("soft-capping");
    }
    if options.reduction == Reduction::None {
        return refuse("per-token losses (Reduction::None): its loss is reduced, Mean or Sum");
    }
    let weight = head.packed();
    let vocab = weight.d_output();
    check_shapes(hidden.dims(), [vocab, weight.d_input], None, targets.dims())?;
    let [tokens, _] = hidden.dims();
    let (rows, kept_targets) = kept_rows(&targets, vocab, options.ignore_index)?;
    let kept = rows.len();
    if kept == 0 {
        // Nothing to learn from: a zero loss with a zero gradient, and no step of the head.
        return Ok((hidden * 0.0).sum());
    }
    let scale = match options.reduction {
        Reduction::Mean => 1.0 / kept as f32,
        _ => 1.0,
    };
    let device = hidden.device();
    let index = |values: &[i64]| {
        Tensor::<1, Int>::from_data(TensorData::new(values.to_vec(), [values.len()]), &device)
    };
    let (rows, targets) = (index(&rows), index(&kept_targets).inner());
    let hidden = if hidden.is_tracked() || !hidden.is_autodiff() {
        hidden
    } else {
        // The head trains even when the hidden states need no gradient.
        hidden.require_grad()
    };
    let h = hidden
        .clone()
        .inner()
        .select(0, rows.clone().inner())
        .cast(FloatDType::F32);
    let (lse, target_logits) = forward(&weight, &h, &targets);
    drop(weight);
    let loss = ((lse.clone() - target_logits).sum() * scale).cast(hidden.dtype());
    if !hidden.is_autodiff() {
        return Ok(loss);
    }
    let backward = HeadBackward {
        head: head.clone(),
        h,
        lse,
        targets,
        rows: rows.inner(),
        tokens,
        scale,
        in_backward: in_backward.cloned(),
    };
    let context = BackwardContext::new(Box::new(backward), Vec::new());
    Ok(attach_backward(hidden, Tensor::from_inner(loss), context))
}

/// Vocabulary rows of one block of a counter head's loss, for `tokens` tokens of width `d`:
/// its logits `[tokens, block]` and weight gradient `[block, d]` stay within 1 MiB of f32.
pub fn counter_loss_block_rows(vocab: usize, tokens: usize, d: usize) -> usize {
    (BLOCK_ELEMENTS / tokens.max(d)).clamp(1, vocab)
}

/// The blocks of vocabulary rows for `tokens` tokens of width `d`.
fn blocks(vocab: usize, tokens: usize, d: usize) -> impl Iterator<Item = (usize, usize)> {
    let block = counter_loss_block_rows(vocab, tokens, d);
    (0..vocab)
        .step_by(block)
        .map(move |start| (start, block.min(vocab - start)))
}

/// Rows `start .. start + len` of `weight` (views of its tensors).
fn block_of(weight: &PackedWeight, start: usize, len: usize) -> PackedWeight {
    PackedWeight {
        codes: weight.codes.clone().narrow(0, start, len),
        scale: weight.scale.clone().narrow(0, start, len),
        ..weight.clone()
    }
}

/// Log-sum-exp `[kept]` of each token's logits, and its target logit `[kept]`.
fn forward(
    weight: &PackedWeight,
    h: &Tensor<2>,
    targets: &Tensor<1, Int>,
) -> (Tensor<1>, Tensor<1>) {
    let [kept, d] = h.dims();
    let mut max = Tensor::<1>::full([kept], f32::NEG_INFINITY, &h.device());
    let mut sum = Tensor::<1>::zeros([kept], &h.device());
    for (start, len) in blocks(weight.d_output(), kept, d) {
        let logits = block_of(weight, start, len).matmul(h.clone());
        let new_max = max
            .clone()
            .max_pair(logits.clone().max_dim(1).squeeze_dim(1));
        sum = sum * (max - new_max.clone()).exp()
            + (logits - new_max.clone().unsqueeze_dim(1))
                .exp()
                .sum_dim(1)
                .squeeze_dim(1);
        max = new_max;
    }
    let target_logits = (weight.rows(targets.clone()) * h.clone())
        .sum_dim(1)
        .squeeze_dim(1);
    (max + sum.log(), target_logits)
}

/// What the loss's backward needs, outside the graph.
#[derive(Debug)]
struct HeadBackward {
    head: CounterWeights,
    /// `[kept, d]` f32: the hidden states of the tokens that count.
    h: Tensor<2>,
    /// `[kept]`.
    lse: Tensor<1>,
    /// `[kept]`.
    targets: Tensor<1, Int>,
    /// `[kept]`: where the kept tokens are among the `tokens`.
    rows: Tensor<1, Int>,
    tokens: usize,
    /// The loss per unit of summed token loss (`1 / kept` for the mean).
    scale: f32,
    in_backward: Option<InBackward>,
}

impl HandwrittenBackward for HeadBackward {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        _param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let HeadBackward {
            head,
            h,
            lse,
            targets,
            rows,
            tokens,
            scale,
            in_backward,
        } = *self;
        let upstream = Tensor::<1>::from_dispatch(output_gradient);
        let dtype = upstream.dtype();
        let upstream = upstream.cast(FloatDType::F32);
        let d_loss = upstream.reshape([1, 1]) * scale;
        let [kept, d] = h.dims();
        let device = h.device();
        let lse = lse.unsqueeze_dim(1);
        let targets = targets.unsqueeze_dim(1);
        let dh = head.train_step(in_backward.as_ref(), |tensors, hyper, step| {
            let mut dh = Tensor::<2>::zeros([kept, d], &device);
            for (start, len) in blocks(tensors.d_output(), kept, d) {
                let block = block_of(&tensors.weight(), start, len);
                let logits = block.matmul(h.clone());
                let columns = Tensor::<1, Int>::arange(start as i64..(start + len) as i64, &device);
                let is_target = targets.clone().equal(columns.unsqueeze_dim(0)).float();
                let d_logits = ((logits - lse.clone()).exp() - is_target) * d_loss.clone();
                dh = dh + block.matmul_transposed(d_logits.clone());
                drop(block); // the update writes in place only when it holds the only handle
                if let Some(hyper) = hyper {
                    let gradient = d_logits.transpose().matmul(h.clone());
                    tensors.update_rows(start..start + len, gradient, hyper, step);
                }
            }
            dh
        });
        let dx = if kept == tokens {
            dh
        } else {
            Tensor::<2>::zeros([tokens, d], &device).select_assign(
                0,
                rows,
                dh,
                IndexingUpdateOp::Add,
            )
        };
        dx.cast(dtype).into_dispatch()
    }
}
