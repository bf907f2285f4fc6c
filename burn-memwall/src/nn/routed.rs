//! Burn's own layers, with their parameters read through an [`InBackward`] so that they are
//! updated during backward: the opt-in for a model built from `burn::nn` layers, without
//! changing the layers or the model's record.

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::module::{embedding, linear};

use super::{CounterEmbedding, CounterLinear, TernaryLinear};
use crate::optim::{InBackward, param_value};

/// The forward passes of `burn::nn` layers, with each parameter anchored on the layer's input.
/// With no [`InBackward`] they are exactly the layers' own `forward`.
#[derive(Clone, Copy, Debug)]
pub struct Routed<'a> {
    in_backward: Option<&'a InBackward>,
}

impl<'a> Routed<'a> {
    /// Routes through `in_backward`; with `None`, every read is `param.val()`.
    pub fn new(in_backward: Option<&'a InBackward>) -> Self {
        Self { in_backward }
    }

    /// `param`'s value for a forward pass, routed so that its update runs in the backward pass,
    /// right after the backward step of the layer whose input is `anchor`.
    ///
    /// With no [`InBackward`], outside training (the anchor does not track gradients) or for a
    /// frozen parameter this is `param.val()`. A first layer with no float input anchors on the
    /// parameter itself.
    ///
    /// Each routed read counts a use that the parameter's update waits for. A forward pass
    /// under autodiff that is dropped without a backward pass leaves its uses counted until the
    /// next [`InBackward::step`] ends, which then updates those parameters after backward
    /// instead of during it: evaluate on `model.valid()` (no autodiff) instead.
    pub fn param<const D: usize, const A: usize>(
        &self,
        param: &Param<Tensor<D>>,
        anchor: &Tensor<A>,
    ) -> Tensor<D> {
        param_value(self.in_backward, param, anchor)
    }

    /// `layer.forward(x)`: `[..., d_input]` → `[..., d_output]`.
    pub fn linear<const D: usize>(&self, layer: &Linear, x: Tensor<D>) -> Tensor<D> {
        let weight = self.param(&layer.weight, &x);
        let bias = layer.bias.as_ref().map(|bias| self.param(bias, &x));
        linear(x, weight, bias)
    }

    /// `layer.forward(x)` with the latent weight (and bias) routed.
    pub fn ternary_linear<const D: usize>(&self, layer: &TernaryLinear, x: Tensor<D>) -> Tensor<D> {
        layer.forward_routed(x, self.in_backward)
    }

    /// `layer.forward(x)`: the weights update themselves in backward at the step's learning
    /// rate; the bias is routed.
    pub fn counter_linear<const D: usize>(&self, layer: &CounterLinear, x: Tensor<D>) -> Tensor<D> {
        layer.forward_routed(x, self.in_backward)
    }

    /// `layer.forward(tokens)`: `[batch, seq]` ids → `[batch, seq, d_model]`; the table updates
    /// itself in backward at the step's learning rate.
    pub fn counter_embedding(&self, layer: &CounterEmbedding, tokens: Tensor<2, Int>) -> Tensor<3> {
        layer.lookup(tokens, self.in_backward)
    }

    /// `norm.forward(x)`: `[..., d_model]` → `[..., d_model]`, with the same arithmetic.
    pub fn rms_norm<const D: usize>(&self, norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
        let gamma = self.param(&norm.gamma, &x);
        let dtype = x.dtype();
        let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + norm.epsilon).sqrt();
        (x / rms.cast(dtype)) * gamma.unsqueeze()
    }

    /// `layer.forward(tokens)`: `[batch, seq]` ids → `[batch, seq, d_model]`. A first layer has
    /// no float input to anchor on, so its weight anchors on itself and is updated last, when
    /// its gradient is complete anyway.
    pub fn embedding(&self, layer: &Embedding, tokens: Tensor<2, Int>) -> Tensor<3> {
        let weight = self.param(&layer.weight, &layer.weight.val());
        embedding(weight, tokens)
    }
}
