//! The handwritten backward: one autodiff node for the whole loss, whose parents are `hidden`,
//! `weight` and `bias`. It saves either the finished gradients
//! (`GradientPass::DuringForward`) or the inputs and one log-sum-exp per token
//! (`GradientPass::Recompute`); nothing of size `tokens × vocab` either way.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients as AutodiffGradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend};

use super::chunked::{self, Gradients, Inputs, Wanted};
use super::{FusedLinearCrossEntropyBackend, GradientPass, LossPlan, RowLoss};

#[derive(Clone, Debug)]
enum Saved<B: FusedLinearCrossEntropyBackend> {
    /// The gradients for an upstream gradient of 1.
    Gradients(Gradients<B>),
    /// What recomputing the logits takes: the inputs, and the log-sum-exp of every chunk.
    Inputs(Inputs<B>, Vec<FloatTensor<B>>, LossPlan),
}

#[derive(Debug)]
struct FusedLinearCrossEntropyBackward;

impl<B: FusedLinearCrossEntropyBackend> Backward<B, 3> for FusedLinearCrossEntropyBackward {
    type State = Saved<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut AutodiffGradients,
        _: &mut Checkpointer,
    ) {
        let d_loss = grads.consume::<B>(&ops.node);
        let wanted = Wanted {
            hidden: ops.parents[0].is_some(),
            weight: ops.parents[1].is_some(),
            bias: ops.parents[2].is_some(),
        };
        let gradients = match ops.state {
            Saved::Gradients(gradients) => gradients.scaled(d_loss),
            Saved::Inputs(inputs, lse, plan) => {
                chunked::gradients(&inputs, &plan, lse, d_loss, wanted)
            }
        };
        let gradients = [gradients.hidden, gradients.weight, gradients.bias];
        for (node, grad) in ops.parents.into_iter().zip(gradients) {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: FusedLinearCrossEntropyBackend, C: CheckpointStrategy> FusedLinearCrossEntropyBackend
    for Autodiff<B, C>
{
    fn fused_linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        rows: IntTensor<Self>,
        targets: IntTensor<Self>,
        plan: LossPlan,
    ) -> FloatTensor<Self> {
        // Only the inputs that take a gradient get one: a frozen head (LoRA) needs no
        // `[vocab, d]` weight gradient.
        let wanted = Wanted {
            hidden: hidden.is_tracked(),
            weight: weight.is_tracked(),
            bias: bias.is_tracked(),
        };
        // A placeholder bias is a constant: no node of its own, so no gradient is computed for it.
        let nodes = [hidden.node(), weight.node(), bias.node()];
        let inputs = Inputs {
            hidden: hidden.into_primitive(),
            weight: weight.into_primitive(),
            bias: plan.has_bias.then(|| bias.into_primitive()),
            rows,
            targets,
        };
        match FusedLinearCrossEntropyBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => match plan.gradients {
                GradientPass::DuringForward => {
                    let (loss, gradients) = chunked::loss_and_gradients(&inputs, &plan, wanted);
                    prep.finish(Saved::Gradients(gradients), loss)
                }
                GradientPass::Recompute => {
                    let (loss, lse) = chunked::loss(&inputs, &plan);
                    prep.finish(Saved::Inputs(inputs, lse, plan), loss)
                }
            },
            OpsKind::UnTracked(prep) => prep.finish(chunked::loss(&inputs, &plan).0),
        }
    }

    /// Not differentiable: a primitive of the differentiable op above.
    fn cross_entropy_rows_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        row_loss: RowLoss,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (loss, lse) = B::cross_entropy_rows_forward(logits.into_primitive(), targets, row_loss);
        (Self::from_inner(loss), Self::from_inner(lse))
    }

    /// Not differentiable (no double backward).
    fn cross_entropy_rows_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        d_loss: FloatTensor<Self>,
        row_loss: RowLoss,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::cross_entropy_rows_backward(
            logits.into_primitive(),
            targets,
            lse.into_primitive(),
            d_loss.into_primitive(),
            row_loss,
        ))
    }
}
