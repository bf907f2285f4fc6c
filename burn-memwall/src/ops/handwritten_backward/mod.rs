//! An output computed outside the autodiff graph, attached to its input with a handwritten
//! backward: the op behind [`crate::nn::ReversibleSequence`] (a chain of reversible blocks as
//! one node, whose backward rebuilds each block's input from its output) and
//! [`crate::nn::CounterLinear`] (whose backward updates the layer's weight code from its
//! gradient and frees it), and the ops that keep less for backward than Burn's autodiff of
//! their composed forms (`rms_norm`, `swiglu`, `relu_squared`).
//!
//! The caller runs its forward pass outside the graph, in typed code, and keeps whatever its
//! backward needs inside a [`HandwrittenBackward`]. This op makes the output a node of the graph
//! whose only parent is the input. When autodiff reaches it, the node hands the output's
//! gradient to the [`HandwrittenBackward`], registers the input gradient it returns, and
//! registers each other gradient it reports (a parameter's, or a second input's) on that
//! tensor's own graph node.

mod autodiff;

use std::sync::{Arc, Mutex};

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, DispatchTensor, Flex, backend_extension};
use burn::module::ParamId;
use burn::prelude::*;

/// A backward pass without its types: `gradient of the output → gradient of the input`, with
/// each parameter's gradient handed to `param_gradient` as soon as it is known. Tensors are
/// outside any autodiff graph.
pub trait HandwrittenBackward: Send + std::fmt::Debug {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor;
}

/// What the op carries from the forward to the backward pass.
#[derive(Clone, Debug)]
pub struct BackwardContext {
    /// Taken once, by the backward pass.
    backward: Arc<Mutex<Option<Box<dyn HandwrittenBackward>>>>,
    /// The tensors besides the input that the backward reports gradients for (trained
    /// parameters, or an op's second input), as autodiff tensors: the op finds the graph node
    /// each gradient belongs to from them, in the forward pass.
    params: Vec<(ParamId, DispatchTensor)>,
}

impl BackwardContext {
    pub fn new(
        backward: Box<dyn HandwrittenBackward>,
        params: Vec<(ParamId, DispatchTensor)>,
    ) -> Self {
        Self {
            backward: Arc::new(Mutex::new(Some(backward))),
            params,
        }
    }

    fn take_backward(&self) -> Box<dyn HandwrittenBackward> {
        self.backward
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .expect("a handwritten backward runs once")
    }
}

#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff, Fusion: cfg(feature = "cube"))]
pub trait HandwrittenBackwardBackend: Backend {
    /// Returns `output` (computed from `input` outside the graph); under autodiff, the node's
    /// only parent is `input`, and its backward runs `backward`.
    #[fusion(default)]
    fn attach_backward(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        backward: BackwardContext,
    ) -> FloatTensor<Self> {
        let _ = (input, backward);
        output
    }

    /// [`Self::attach_backward`] with `parent` as a second parent of the node, so that the
    /// backward pass reaches `parent` only after this node. Give `parent` (a weight whose
    /// gradient the backward reports) when something downstream of it must wait for that
    /// gradient, such as an update hook of [`crate::optim::InBackward`].
    #[fusion(default)]
    fn attach_backward_after(
        input: FloatTensor<Self>,
        parent: FloatTensor<Self>,
        output: FloatTensor<Self>,
        backward: BackwardContext,
    ) -> FloatTensor<Self> {
        let _ = (input, parent, backward);
        output
    }

    /// [`Self::attach_backward_after`] with two such parents: for a backward that reports
    /// gradients for a second input and a weight.
    #[fusion(default)]
    fn attach_backward_after_both(
        input: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        output: FloatTensor<Self>,
        backward: BackwardContext,
    ) -> FloatTensor<Self> {
        let _ = (input, first, second, backward);
        output
    }
}

impl HandwrittenBackwardBackend for Flex {}
#[cfg(feature = "cube")]
impl HandwrittenBackwardBackend for burn_cubecl::CubeBackend {}

/// `output`, computed outside the graph from `input`, attached to `input` so that the backward
/// pass runs the handwritten backward in `context`.
pub fn attach_backward<const D: usize, const E: usize>(
    input: Tensor<D>,
    output: Tensor<E>,
    context: BackwardContext,
) -> Tensor<E> {
    Tensor::from_dispatch(Dispatch::attach_backward(
        input.into_dispatch(),
        output.into_dispatch(),
        context,
    ))
}

/// [`attach_backward`] with `parent` (a weight the backward reports a gradient for, listed in
/// `context`'s parameters) also a parent of the node: autodiff then reaches `parent`, and
/// whatever hangs on it, only after this node has handed over its gradient.
pub fn attach_backward_after<const D: usize, const P: usize, const E: usize>(
    input: Tensor<D>,
    parent: Tensor<P>,
    output: Tensor<E>,
    context: BackwardContext,
) -> Tensor<E> {
    Tensor::from_dispatch(Dispatch::attach_backward_after(
        input.into_dispatch(),
        parent.into_dispatch(),
        output.into_dispatch(),
        context,
    ))
}

/// [`attach_backward_after`] with two parents besides the input (a second input and a weight,
/// say), each reached only after this node has handed over its gradient.
pub fn attach_backward_after_both<
    const D: usize,
    const P: usize,
    const Q: usize,
    const E: usize,
>(
    input: Tensor<D>,
    first: Tensor<P>,
    second: Tensor<Q>,
    output: Tensor<E>,
    context: BackwardContext,
) -> Tensor<E> {
    Tensor::from_dispatch(Dispatch::attach_backward_after_both(
        input.into_dispatch(),
        first.into_dispatch(),
        second.into_dispatch(),
        output.into_dispatch(),
        context,
    ))
}
