//! The dense linear that an MLP activation's node folds in (its down projection): the node
//! keeps what the activation's backward reads and, for the linear, a handle on its weight, where
//! Burn's linear would keep the activation's output as its input.

use burn::backend::DispatchTensor;
use burn::module::ParamId;
use burn::prelude::*;

/// `hidden · weight` inside another op's node, for activations of shape `[..., d_ff]` handled as
/// `[rows, d_ff]`.
#[derive(Debug)]
pub(super) struct FoldedLinear<const D: usize> {
    /// `[d_ff, d_output]`, outside the graph.
    weight: Tensor<2>,
    /// The key under which the weight's gradient is handed over, when it is tracked.
    key: Option<ParamId>,
    /// The activation's shape.
    dims: [usize; D],
}

impl<const D: usize> FoldedLinear<D> {
    /// The linear by `weight` (`burn::nn::Linear`'s layout, `[d_ff, d_output]`) of an
    /// activation of shape `dims`, inside `op`.
    ///
    /// # Panics
    /// If `weight` does not take `d_ff` inputs.
    pub(super) fn new(op: &str, dims: [usize; D], weight: &Tensor<2>) -> Self {
        let [d_ff, _] = weight.dims();
        assert_eq!(
            dims[D - 1],
            d_ff,
            "{op}: the weight takes {d_ff} inputs, the activation has {}",
            dims[D - 1]
        );
        Self {
            weight: weight.clone().inner(),
            key: weight.is_tracked().then(ParamId::new),
            dims,
        }
    }

    /// The activation's shape.
    pub(super) fn dims(&self) -> [usize; D] {
        self.dims
    }

    /// `x` (of the activation's shape) as `[rows, d_ff]`, outside the graph.
    pub(super) fn rows(&self, x: &Tensor<D>) -> Tensor<2> {
        let rows = self.dims[..D - 1].iter().product();
        x.clone().inner().reshape([rows, self.dims[D - 1]])
    }

    /// `hidden · weight`, `[rows, d_ff]` → `[..., d_output]`, outside the graph.
    pub(super) fn forward(&self, hidden: Tensor<2>) -> Tensor<D> {
        let mut out = self.dims;
        out[D - 1] = self.weight.dims()[1];
        Tensor::from_inner(hidden.matmul(self.weight.clone()).reshape(out))
    }

    /// `weight` (the tensor [`Self::new`] was given) under the key its gradient is handed over
    /// with, when it is tracked: for the node's [`super::handwritten_backward::BackwardContext`].
    pub(super) fn tracked_weight(&self, weight: &Tensor<2>) -> Option<(ParamId, DispatchTensor)> {
        self.key.map(|key| (key, weight.clone().into_dispatch()))
    }

    /// From the output's gradient `dy`: hands the weight's gradient `hiddenᵀ·dy` over (making
    /// `hidden` only when the weight is tracked) and returns `dh = dy·Wᵀ`, `[rows, d_ff]`.
    pub(super) fn backward(
        &self,
        output_gradient: DispatchTensor,
        hidden: impl FnOnce() -> Tensor<2>,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> Tensor<2> {
        let rows = self.dims[..D - 1].iter().product();
        let dy = Tensor::<D>::from_dispatch(output_gradient).reshape([rows, self.weight.dims()[1]]);
        if let Some(key) = self.key {
            param_gradient(key, hidden().transpose().matmul(dy.clone()).into_dispatch());
        }
        dy.matmul(self.weight.clone().transpose())
    }
}

/// `y + bias`, the bias broadcast over `y`'s rows.
pub(super) fn plus_bias<const D: usize>(y: Tensor<D>, bias: Option<Tensor<1>>) -> Tensor<D> {
    match bias {
        Some(bias) => y + bias.unsqueeze(),
        None => y,
    }
}
