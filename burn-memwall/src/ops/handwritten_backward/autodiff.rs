//! The graph node: the handwritten backward runs when autodiff reaches the output.

use std::collections::HashMap;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, BackendTensor, DispatchKindConversion, DispatchTensor};
use burn::module::ParamId;

use super::{BackwardContext, HandwrittenBackwardBackend};

/// The node; `N` parents, the input first.
#[derive(Debug)]
struct AttachedBackward<const N: usize>;

/// The handwritten backward, and the graph node of each parameter's gradient.
type Saved = (BackwardContext, HashMap<ParamId, NodeId>);

impl<B: Backend, const N: usize> Backward<B, N> for AttachedBackward<N>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let node_input = ops.parents[0].clone();
        let output_gradient = grads.consume::<B>(&ops.node);
        let (context, nodes) = ops.state;
        let input_gradient = context.take_backward().backward(
            dispatch::<B>(output_gradient),
            &mut |id, gradient| {
                if let Some(node) = nodes.get(&id) {
                    grads.register::<B>(*node, primitive::<B>(gradient));
                }
            },
        );
        if let Some(node) = node_input {
            grads.register::<B>(node.id, primitive::<B>(input_gradient));
        }
    }
}

fn dispatch<B: Backend>(tensor: FloatTensor<B>) -> DispatchTensor
where
    DispatchTensor: DispatchKindConversion<B>,
{
    <DispatchTensor as DispatchKindConversion<B>>::from_backend(BackendTensor::Float(tensor))
}

fn primitive<B: Backend>(tensor: DispatchTensor) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    match <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(tensor) {
        Ok(BackendTensor::Float(tensor)) => tensor,
        Ok(_) => unreachable!("a float tensor stays a float tensor"),
        Err(error) => panic!("a handwritten backward's gradient is on another backend: {error}"),
    }
}

impl<B: HandwrittenBackwardBackend, C: CheckpointStrategy> HandwrittenBackwardBackend
    for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    fn attach_backward(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        backward: BackwardContext,
    ) -> FloatTensor<Self> {
        attach::<B, C, 1>([input.node()], output, backward)
    }

    fn attach_backward_after(
        input: FloatTensor<Self>,
        parent: FloatTensor<Self>,
        output: FloatTensor<Self>,
        backward: BackwardContext,
    ) -> FloatTensor<Self> {
        attach::<B, C, 2>([input.node(), parent.node()], output, backward)
    }

    fn attach_backward_after_both(
        input: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        output: FloatTensor<Self>,
        backward: BackwardContext,
    ) -> FloatTensor<Self> {
        attach::<B, C, 3>(
            [input.node(), first.node(), second.node()],
            output,
            backward,
        )
    }
}

fn attach<B: HandwrittenBackwardBackend, C: CheckpointStrategy, const N: usize>(
    parents: [NodeGuard; N],
    output: FloatTensor<Autodiff<B, C>>,
    backward: BackwardContext,
) -> FloatTensor<Autodiff<B, C>>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    match AttachedBackward::<N>
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let nodes = backward
                .params
                .iter()
                .map(|(id, param)| (*id, node_of::<B, C>(param.clone())))
                .collect();
            let context = BackwardContext {
                params: Vec::new(),
                ..backward
            };
            prep.finish((context, nodes), output.into_primitive())
        }
        OpsKind::UnTracked(prep) => prep.finish(output.into_primitive()),
    }
}

/// The graph node of a parameter's autodiff tensor.
fn node_of<B: Backend, C: CheckpointStrategy>(param: DispatchTensor) -> NodeId
where
    DispatchTensor: DispatchKindConversion<Autodiff<B, C>>,
{
    match <DispatchTensor as DispatchKindConversion<Autodiff<B, C>>>::try_into_backend(param) {
        Ok(BackendTensor::Float(tensor)) => tensor.id(),
        Ok(_) => unreachable!("a float tensor stays a float tensor"),
        Err(error) => panic!(
            "a parameter of a handwritten backward must be on its input's autodiff device: {error}"
        ),
    }
}
