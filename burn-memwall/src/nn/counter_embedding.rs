//! [`CounterEmbedding`]; the type's docs are the description.

use burn::backend::DispatchTensor;
use burn::module::{Module, ParamId};
use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::{FloatDType, IndexingUpdateOp};

use super::{CounterLinearConfig, CounterWeights};
use crate::ops::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward};
use crate::ops::packed_matmul::row_blocks;
use crate::optim::InBackward;

/// A token embedding of counter synapses: a drop-in for `burn::nn::Embedding` that trains
/// itself in backward.
///
/// Its table is a [`CounterWeights`] code, one weight
/// row per token: 0.77 byte per weight, no `Param`, no optimizer state and no dense gradient.
///
/// The lookup decodes only the rows of the ids it reads ([`PackedWeight::rows`]). Its backward
/// pass updates the table from the exact gradient, a block of rows at a time: each block's
/// gradient is the sum of the output gradients of the positions whose ids fall in it, and is
/// dropped once the block is updated. Every row takes the step, those without a position with
/// a zero gradient, so the update is the one a dense `[vocab, d_model]` gradient would give.
///
/// [`PackedWeight::rows`]: crate::nn::PackedWeight::rows
#[derive(Module, Debug)]
pub struct CounterEmbedding {
    /// `[n_embedding, d_model]`: a row per token.
    pub weights: CounterWeights,
}

impl CounterEmbedding {
    /// `embedding`'s table as codes: the `[n_embedding, d_model]` weight of `config`, which is
    /// `CounterLinearConfig::new(d_model, n_embedding).with_bias(false)` with any counter
    /// settings (limit, learning rates, `β`, `ε`, seed).
    ///
    /// # Panics
    /// If `config`'s shape is not the table's, it asks for a bias, or its counter limit is out
    /// of range.
    pub fn from_embedding(embedding: Embedding, config: &CounterLinearConfig) -> Self {
        let [n_embedding, d_model] = embedding.weight.dims();
        assert!(
            (config.d_input, config.d_output, config.bias) == (d_model, n_embedding, false),
            "CounterEmbedding: the config must be CounterLinearConfig::new({d_model}, \
             {n_embedding}).with_bias(false) for a [{n_embedding}, {d_model}] table"
        );
        Self {
            weights: config.weights_from_rows(embedding.weight.val()),
        }
    }

    /// `[batch, seq]` ids → `[batch, seq, d_model]`; under autodiff, the backward pass updates
    /// the table. In a model trained by [`InBackward`], use
    /// [`crate::nn::Routed::counter_embedding`] instead: the update then takes the step's
    /// learning rate, so it follows the schedule.
    ///
    /// # Panics
    /// On an id outside `0..n_embedding`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.lookup(tokens, None)
    }

    /// [`Self::forward`], updating at the learning rate of `in_backward`'s running step, if any.
    pub(crate) fn lookup(
        &self,
        tokens: Tensor<2, Int>,
        in_backward: Option<&InBackward>,
    ) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let ids = tokens.reshape([batch * seq]).inner();
        let table = self.weights.packed();
        let host_ids = host_ids(&ids);
        let vocab = table.d_output();
        if let Some(id) = host_ids
            .iter()
            .find(|&&id| !(0..vocab as i64).contains(&id))
        {
            panic!("CounterEmbedding: token id {id} is outside [0, {vocab})");
        }
        let rows = table.rows(ids);
        let d_model = rows.dims()[1];
        // The table has no float input to hang on: a one-element leaf stands in, so that the
        // lookup is a node of the graph whose backward runs.
        let anchor = Tensor::<1>::zeros([1], &device);
        if !anchor.is_autodiff() {
            return rows.reshape([batch, seq, d_model]);
        }
        let backward = EmbeddingBackward {
            weights: self.weights.clone(),
            ids: host_ids,
            in_backward: in_backward.cloned(),
        };
        let context = BackwardContext::new(Box::new(backward), Vec::new());
        attach_backward(anchor.require_grad(), Tensor::from_inner(rows), context)
            .reshape([batch, seq, d_model])
    }
}

fn host_ids(ids: &Tensor<1, Int>) -> Vec<i64> {
    ids.to_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("converted to i64")
}

/// What the lookup's backward needs: the table (shared, to update it), the ids read, and where
/// the step's learning rate comes from.
#[derive(Debug)]
struct EmbeddingBackward {
    weights: CounterWeights,
    ids: Vec<i64>,
    in_backward: Option<InBackward>,
}

impl HandwrittenBackward for EmbeddingBackward {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        _param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let EmbeddingBackward {
            weights,
            ids,
            in_backward,
        } = *self;
        let dy = Tensor::<2>::from_dispatch(output_gradient).cast(FloatDType::F32);
        let [_, d_model] = dy.dims();
        let device = dy.device();
        let index = |values: Vec<i64>| {
            let len = values.len();
            Tensor::<1, Int>::from_data(TensorData::new(values, [len]), &device)
        };
        weights.train_step(in_backward.as_ref(), |tensors, hyper, step| {
            // A frozen table has no gradient to pass on: the ids are not differentiable.
            let Some(hyper) = hyper else { return };
            for rows in row_blocks(d_model, tensors.d_output()) {
                let (positions, local): (Vec<i64>, Vec<i64>) = ids
                    .iter()
                    .enumerate()
                    .filter(|(_, id)| rows.contains(&(**id as usize)))
                    .map(|(position, id)| (position as i64, id - rows.start as i64))
                    .unzip();
                let mut gradient = Tensor::<2>::zeros([rows.len(), d_model], &device);
                if !positions.is_empty() {
                    gradient = gradient.select_assign(
                        0,
                        index(local),
                        dy.clone().select(0, index(positions)),
                        IndexingUpdateOp::Add,
                    );
                }
                tensors.update_rows(rows, gradient, hyper, step);
            }
        });
        // The anchor's gradient: nothing reads it.
        Tensor::<1>::zeros([1], &device).into_dispatch()
    }
}
