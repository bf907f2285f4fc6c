//! The LM-head loss on [`fused_linear_cross_entropy`]: `Linear` + `CrossEntropyLoss` without the
//! `[tokens, vocab]` logits, in the forward pass or the backward.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::prelude::*;

use super::counter_cross_entropy::counter_cross_entropy;
use super::{CounterWeights, GradientPass, Reduction, Routed};
use crate::ops::fused_linear_cross_entropy::{
    FusedCrossEntropyError, FusedCrossEntropyOptions, RowLoss, fused_loss,
};
use crate::optim::InBackward;

/// Configuration of [`FusedLinearCrossEntropyLoss`]; the defaults are plain mean cross-entropy,
/// as `CrossEntropyLossConfig::new()`.
#[derive(Config, Debug)]
pub struct FusedLinearCrossEntropyLossConfig {
    /// Tokens with this target are left out (Burn's `pad_tokens`, for one padding id).
    pub ignore_index: Option<usize>,
    /// How the per-token losses are combined.
    #[config(default = "Reduction::Mean")]
    pub reduction: Reduction,
    /// Label smoothing `ε` in `[0, 1]` (Burn's `smoothing`).
    #[config(default = 0.0)]
    pub label_smoothing: f64,
    /// Coefficient of the z-loss `λ·lse²` (PaLM); 0 turns it off.
    #[config(default = 0.0)]
    pub z_loss: f64,
    /// Logit soft-capping `c · tanh(z / c)` (Gemma 2).
    pub softcap: Option<f64>,
    /// Tokens per chunk; `None` picks
    /// [`crate::ops::fused_linear_cross_entropy::DEFAULT_CHUNK_TOKENS`].
    pub chunk_size: Option<usize>,
    /// When the gradients of a reduced loss are computed.
    #[config(default = "GradientPass::DuringForward")]
    pub gradients: GradientPass,
}

impl FusedLinearCrossEntropyLossConfig {
    /// The loss, its options checked once here.
    ///
    /// # Panics
    /// With the [`FusedCrossEntropyError`]'s message when an option is out of its range
    /// (label smoothing outside `[0, 1]`, a negative or non-finite z-loss, a soft-cap that is
    /// not finite and positive, a chunk of 0 tokens).
    pub fn init(&self) -> FusedLinearCrossEntropyLoss {
        let options = FusedCrossEntropyOptions {
            ignore_index: self.ignore_index,
            reduction: self.reduction,
            label_smoothing: self.label_smoothing,
            z_loss: self.z_loss,
            softcap: self.softcap,
            chunk_size: self.chunk_size,
            vocab_slices: None,
            gradients: self.gradients,
        };
        let row_loss = options.row_loss().unwrap_or_else(|error| panic!("{error}"));
        FusedLinearCrossEntropyLoss { options, row_loss }
    }
}

/// Cross-entropy of an LM head's logits, computed from the hidden states and the head's weight
/// without ever holding the logits. Replaces `CrossEntropyLoss::forward(head.forward(hidden),
/// targets)` by `loss.forward(hidden, &head, targets)`: the head stays Burn's own `Linear`
/// (same weights, same record), or the token embedding when the two are tied.
///
/// Hidden states are `[..., d_model]` with targets `[...]` (for example `[batch, seq, d_model]`
/// and `[batch, seq]`); the loss is `[1]`, or one per token (flattened) for `Reduction::None`.
/// Reads the targets back once per call to check them (see
/// [`crate::ops::fused_linear_cross_entropy::try_fused_linear_cross_entropy`]).
#[derive(Module, Debug)]
pub struct FusedLinearCrossEntropyLoss {
    #[module(skip)]
    options: FusedCrossEntropyOptions,
    /// The options' loss terms, checked by the config's `init`.
    #[module(skip)]
    row_loss: RowLoss,
}

impl FusedLinearCrossEntropyLoss {
    /// The loss of `head.forward(hidden)` (a `Linear` `[d_model] → [vocab]`, bias included).
    ///
    /// # Shapes
    /// - `hidden`: `[..., d_model]`
    /// - `targets`: `[...]`, each in `0..vocab` or the config's `ignore_index`
    /// - output: `[1]`, or one loss per token (flattened) for `Reduction::None`
    ///
    /// # Panics
    /// With the [`FusedCrossEntropyError`]'s message on shapes that do not fit or targets
    /// outside the vocabulary; [`Self::try_forward`] returns the error instead.
    pub fn forward<const D: usize, const T: usize>(
        &self,
        hidden: Tensor<D>,
        head: &Linear,
        targets: Tensor<T, Int>,
    ) -> Tensor<1> {
        self.try_forward(hidden, head, targets)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// [`Self::forward`], returning bad input as an error: a caller that reads targets from
    /// data it does not control can skip the batch instead of stopping.
    pub fn try_forward<const D: usize, const T: usize>(
        &self,
        hidden: Tensor<D>,
        head: &Linear,
        targets: Tensor<T, Int>,
    ) -> Result<Tensor<1>, FusedCrossEntropyError> {
        self.try_forward_routed(hidden, head, targets, Routed::new(None))
    }

    /// [`Self::try_forward`] with the head's parameters read through `route`.
    pub(crate) fn try_forward_routed<const D: usize, const T: usize>(
        &self,
        hidden: Tensor<D>,
        head: &Linear,
        targets: Tensor<T, Int>,
        route: Routed,
    ) -> Result<Tensor<1>, FusedCrossEntropyError> {
        // `Linear` stores `[d_model, vocab]`; the op reads `[vocab, d_model]` (a view, no copy).
        let weight = route.param(&head.weight, &hidden).transpose();
        let bias = head.bias.as_ref().map(|bias| route.param(bias, &hidden));
        self.try_forward_weights(hidden, weight, bias, targets)
    }

    /// The loss of logits `hidden · embeddingᵀ`: an LM head tied to the token embedding.
    /// Its gradient adds to the embedding lookup's.
    ///
    /// # Panics
    /// As [`Self::forward`].
    pub fn forward_tied<const D: usize, const T: usize>(
        &self,
        hidden: Tensor<D>,
        embedding: &Embedding,
        targets: Tensor<T, Int>,
    ) -> Tensor<1> {
        self.try_forward_weights(hidden, embedding.weight.val(), None, targets)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// The loss of logits `hidden · Wᵀ` for a head whose weight `W` (`[vocab, d_model]`) is a
    /// counter code: a [`CounterLinear`]'s weights, or a [`CounterEmbedding`]'s table when the
    /// head is tied to it. The vocabulary is walked in blocks (see `counter_cross_entropy.rs`),
    /// so neither the logits nor a dense weight gradient exist; the backward pass updates the
    /// code (at the learning rate of `in_backward`'s running step, if any). `chunk_size` and
    /// `gradients` are not read; label smoothing, the z-loss, soft-capping and
    /// `Reduction::None` are refused.
    ///
    /// [`CounterLinear`]: super::CounterLinear
    /// [`CounterEmbedding`]: super::CounterEmbedding
    pub fn try_forward_counter<const D: usize, const T: usize>(
        &self,
        hidden: Tensor<D>,
        head: &CounterWeights,
        targets: Tensor<T, Int>,
        in_backward: Option<&InBackward>,
    ) -> Result<Tensor<1>, FusedCrossEntropyError> {
        let (hidden, targets) = flat_tokens(hidden, targets)?;
        counter_cross_entropy(hidden, head, targets, &self.options, in_backward)
    }

    /// The loss of logits `hidden · weightᵀ + bias` for a head the caller has read:
    /// `weight` is `[vocab, d_model]` and `bias` `[vocab]` (for example routed through
    /// [`crate::optim::InBackward`]).
    pub fn try_forward_weights<const D: usize, const T: usize>(
        &self,
        hidden: Tensor<D>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        targets: Tensor<T, Int>,
    ) -> Result<Tensor<1>, FusedCrossEntropyError> {
        let (hidden, targets) = flat_tokens(hidden, targets)?;
        fused_loss(hidden, weight, bias, targets, &self.options, self.row_loss)
    }
}

/// `[..., d_model]` hidden states and `[...]` targets as `[tokens, d_model]` and `[tokens]`.
fn flat_tokens<const D: usize, const T: usize>(
    hidden: Tensor<D>,
    targets: Tensor<T, Int>,
) -> Result<(Tensor<2>, Tensor<1, Int>), FusedCrossEntropyError> {
    let (hidden_dims, target_dims) = (hidden.dims(), targets.dims());
    if D < 2 || hidden_dims[..D - 1] != target_dims[..] {
        return Err(FusedCrossEntropyError::Targets {
            targets: target_dims.to_vec(),
            hidden: hidden_dims.to_vec(),
        });
    }
    Ok((hidden.flatten(0, D - 2), targets.flatten(0, T - 1)))
}
