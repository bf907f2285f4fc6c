//! The hook op: the identity in the forward pass; in the backward pass it hands the parameter's
//! complete gradient to the [`InBackward`] handle instead of passing it on to the parameter.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, Backend, BackendTensor, DispatchKindConversion, DispatchTensor, Flex,
    backend_extension,
};
use burn::module::ParamId;
use burn::tensor::kind::BridgeTensor;

use super::InBackward;

/// Monomorphised for the parameter's rank when the hook is created, so that the rank-agnostic
/// backward can hand `(value, gradient)` to rank-typed optimizer code.
pub(super) type ApplyGradient = fn(&InBackward, ParamId, BridgeTensor, BridgeTensor);

/// What a hook node carries to the backward pass.
#[derive(Clone, Debug)]
pub struct HookContext {
    pub(super) id: ParamId,
    pub(super) apply: ApplyGradient,
    pub(super) owner: InBackward,
}

#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff, Fusion: cfg(feature = "cube"))]
pub trait ParamHookBackend: Backend {
    /// Returns `value` unchanged. Under autodiff, the node's parents are `value` (the parameter)
    /// and `anchor` (the input of the layer that uses it): the anchor only sets the node's depth,
    /// so that its backward step runs right after the layer's own, not at the end of backward.
    #[fusion(default)]
    fn param_hook(
        value: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        context: HookContext,
    ) -> FloatTensor<Self> {
        let _ = (anchor, context);
        value
    }
}

impl ParamHookBackend for Flex {}
#[cfg(feature = "cube")]
impl ParamHookBackend for burn_cubecl::CubeBackend {}

#[derive(Debug)]
struct ParamHookBackward;

impl<B: Backend> Backward<B, 2> for ParamHookBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = (FloatTensor<B>, HookContext);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        // The hook is an intermediate node: `consume` removes its gradient from the tape, and
        // nothing is registered on the parameter, so the parameter never holds a gradient.
        let gradient = grads.consume::<B>(&ops.node);
        let (value, context) = ops.state;
        if !context.owner.stepping() {
            // A plain `loss.backward()`: the identity's backward, so the parameter gets its
            // gradient and a standard optimizer step can use it.
            context.owner.release_use(context.id);
            if let Some(parent) = &ops.parents[0] {
                grads.register::<B>(parent.id, gradient);
            }
            return;
        }
        (context.apply)(
            &context.owner,
            context.id,
            bridge::<B>(value),
            bridge::<B>(gradient),
        );
    }
}

fn bridge<B: Backend>(tensor: FloatTensor<B>) -> BridgeTensor
where
    DispatchTensor: DispatchKindConversion<B>,
{
    BridgeTensor::float(<DispatchTensor as DispatchKindConversion<B>>::from_backend(
        BackendTensor::Float(tensor),
    ))
}

impl<B: ParamHookBackend, C: CheckpointStrategy> ParamHookBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn param_hook(
        value: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        context: HookContext,
    ) -> FloatTensor<Self> {
        match ParamHookBackward
            .prepare::<C>([value.node(), anchor.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let value = value.into_primitive();
                prep.finish((value.clone(), context), value)
            }
            OpsKind::UnTracked(prep) => prep.finish(value.into_primitive()),
        }
    }
}
