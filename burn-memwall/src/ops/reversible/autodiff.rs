//! The handwritten backward: the chain rebuilds what it needs from the output.

use std::collections::HashMap;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, BackendTensor, DispatchKindConversion, DispatchTensor};
use burn::module::ParamId;

use super::{ChainContext, ReversibleBackend};

#[derive(Debug)]
struct ReversibleBackward;

/// The output, the chain, and the graph node of each parameter's gradient.
type Saved<B> = (FloatTensor<B>, ChainContext, HashMap<ParamId, NodeId>);

impl<B: Backend> Backward<B, 1> for ReversibleBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_input] = ops.parents;
        let output_gradient = grads.consume::<B>(&ops.node);
        let (output, context, nodes) = ops.state;
        let chain = context.take_chain();
        let input_gradient = chain.backward(
            dispatch::<B>(output),
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
        Err(error) => panic!("a reversible chain's gradient is on another backend: {error}"),
    }
}

impl<B: ReversibleBackend, C: CheckpointStrategy> ReversibleBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    fn reversible_attach(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        chain: ChainContext,
    ) -> FloatTensor<Self> {
        match ReversibleBackward
            .prepare::<C>([input.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let nodes = chain
                    .params
                    .iter()
                    .map(|(id, param)| (*id, node_of::<B, C>(param.clone())))
                    .collect();
                let output = output.into_primitive();
                let context = ChainContext {
                    params: Vec::new(),
                    ..chain
                };
                prep.finish((output.clone(), context, nodes), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output.into_primitive()),
        }
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
            "a reversible chain's parameter must be on the chain input's autodiff device: {error}"
        ),
    }
}
