//! The autodiff op behind [`crate::nn::ReversibleSequence`]: a chain of reversible blocks as one
//! node of the graph, whose backward rebuilds each block's input from its output instead of
//! reading it from memory.
//!
//! The chain's forward runs outside the graph (in the typed code of the module); this op then
//! attaches its output to the chain's input with a handwritten backward. The forward keeps only
//! the output (and, when asked, every few blocks' input). The backward hands the output and its
//! gradient to a [`ReversibleChain`], which walks the blocks from the last, and registers the
//! gradient of the chain's input and of every parameter the chain reports.

mod autodiff;

use std::sync::{Arc, Mutex};

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, DispatchTensor, Flex, backend_extension};
use burn::module::ParamId;
use burn::prelude::*;

/// The chain's backward, without its types: `(output, gradient of the output) → gradient of the
/// input`, with each parameter's gradient handed to `param_gradient` as soon as it is known.
/// Tensors are outside any autodiff graph.
pub trait ReversibleChain: Send + std::fmt::Debug {
    fn backward(
        self: Box<Self>,
        output: DispatchTensor,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor;
}

/// What the op carries from the forward to the backward pass.
#[derive(Clone, Debug)]
pub struct ChainContext {
    /// Taken once, by the backward pass.
    chain: Arc<Mutex<Option<Box<dyn ReversibleChain>>>>,
    /// The trained parameters the chain reads, as autodiff tensors: the op finds the graph
    /// node each gradient belongs to from them, in the forward pass.
    params: Vec<(ParamId, DispatchTensor)>,
}

impl ChainContext {
    pub fn new(chain: Box<dyn ReversibleChain>, params: Vec<(ParamId, DispatchTensor)>) -> Self {
        Self {
            chain: Arc::new(Mutex::new(Some(chain))),
            params,
        }
    }

    fn take_chain(&self) -> Box<dyn ReversibleChain> {
        self.chain
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .expect("a reversible chain is walked back once")
    }
}

#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff, Fusion: cfg(feature = "cube"))]
pub trait ReversibleBackend: Backend {
    /// Returns `output` (computed from `input` by the chain); under autodiff, the node's only
    /// parent is `input`, and its backward walks the chain.
    #[fusion(default)]
    fn reversible_attach(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        chain: ChainContext,
    ) -> FloatTensor<Self> {
        let _ = (input, chain);
        output
    }
}

impl ReversibleBackend for Flex {}
#[cfg(feature = "cube")]
impl ReversibleBackend for burn_cubecl::CubeBackend {}

/// `output`, computed outside the graph from `input` by the chain in `context`, attached to
/// `input` so that backward runs the chain's own backward.
pub fn reversible_attach<const D: usize>(
    input: Tensor<D>,
    output: Tensor<D>,
    context: ChainContext,
) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::reversible_attach(
        input.into_dispatch(),
        output.into_dispatch(),
        context,
    ))
}
