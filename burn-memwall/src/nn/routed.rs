//! Burn's own layers, with their parameters read through an [`InBackward`] so that they are
//! updated during backward: the opt-in for a model built from `burn::nn` layers, without
//! changing the layers or the model's record.

use burn::module::Param;
use burn::nn::transformer::PositionWiseFeedForward;
use burn::nn::{Embedding, LayerNorm, Linear, RmsNorm};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::module::{embedding, linear};

use super::{
    CounterEmbedding, CounterLinear, FlashMhaInput, FlashMultiHeadAttention,
    FlashTransformerEncoder, FlashTransformerEncoderInput, FusedLinearCrossEntropyLoss,
    TernaryLinear,
};
use crate::host::same_memory;
use crate::ops::relu_squared::{relu_squared, relu_squared_linear};
use crate::ops::rms_norm::rms_norm;
use crate::ops::saved_rows::SavedPrecision;
use crate::ops::swiglu::{swiglu, swiglu_linear};
use crate::optim::{InBackward, param_value};

/// The forward passes of `burn::nn` layers, with each parameter anchored on the layer's input.
/// With no [`InBackward`] they compute the layers' own `forward` (a LoRA-adapted linear
/// without its composed weight: [`Routed::linear`]).
#[derive(Clone, Copy, Debug)]
pub struct Routed<'a> {
    in_backward: Option<&'a InBackward>,
}

impl<'a> Routed<'a> {
    /// Routes through `in_backward`; with `None`, every read is `param.val()`.
    pub fn new(in_backward: Option<&'a InBackward>) -> Self {
        Self { in_backward }
    }

    /// The [`InBackward`] the parameters are routed through.
    pub(crate) fn in_backward(&self) -> Option<&'a InBackward> {
        self.in_backward
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
    ///
    /// A weight adapted by Burn's `Module::apply_lora` (`W + s·A·B`) is applied as
    /// `x·W + s·(x·A)·B`: the same function, without the composed `[d_input, d_output]` weight
    /// that Burn's `Linear::forward` builds each call and keeps for the backward pass, nor that
    /// weight's full-size gradient. The backward keeps `x` and `x·A` (`rank` wide) instead.
    pub fn linear<const D: usize>(&self, layer: &Linear, x: Tensor<D>) -> Tensor<D> {
        // Read in `Linear::forward`'s order (weight, then bias): Burn draws a parameter's
        // initial value at its first read, so the order decides which values each one gets.
        let Some(adapter) = layer.weight.adapter() else {
            let weight = self.param(&layer.weight, &x);
            let bias = layer.bias.as_ref().map(|bias| self.param(bias, &x));
            return linear(x, weight, bias);
        };
        // Frozen, as LoRA leaves it, unless the caller unfroze it (then it is routed too).
        let base = self.param(
            &Param::initialized(layer.weight.id, layer.weight.base()),
            &x,
        );
        let (a, b) = (self.param(&adapter.a, &x), self.param(&adapter.b, &x));
        let bias = layer.bias.as_ref().map(|bias| self.param(bias, &x));
        let low_rank = linear(linear(x.clone(), a, None), b, None).mul_scalar(adapter.scale);
        linear(x, base, bias) + low_rank
    }

    /// `layer.forward(swiglu(gate, up))` through [`crate::ops::swiglu::swiglu_linear`]: the
    /// same values, with a backward pass that keeps `gate` and `up` and recomputes the product,
    /// which Burn's linear keeps as its input. A LoRA-adapted `layer` reads the product through
    /// [`Routed::linear`] instead: its adapter keeps `x·A` of it anyway. `saved` says how
    /// `gate` and `up` are kept (see [`crate::ops::swiglu::swiglu_linear`]).
    ///
    /// # Shapes
    /// - `gate`, `up`: `[..., d_input]`
    /// - output: `[..., d_output]`
    pub fn swiglu_linear<const D: usize>(
        &self,
        layer: &Linear,
        gate: Tensor<D>,
        up: Tensor<D>,
        saved: SavedPrecision,
    ) -> Tensor<D> {
        if layer.weight.adapter().is_some() {
            return self.linear(layer, swiglu(gate, up));
        }
        let weight = self.param(&layer.weight, &gate);
        let bias = layer.bias.as_ref().map(|bias| self.param(bias, &gate));
        swiglu_linear(gate, up, weight, bias, saved)
    }

    /// `layer.forward(relu(u)²)` through [`crate::ops::relu_squared::relu_squared_linear`]:
    /// the same values, with a backward pass that keeps `relu(u)` as `saved` says. A
    /// LoRA-adapted `layer` reads the square through [`Routed::linear`] instead.
    ///
    /// # Shapes
    /// - `u`: `[..., d_input]`
    /// - output: `[..., d_output]`
    pub fn relu_squared_linear<const D: usize>(
        &self,
        layer: &Linear,
        u: Tensor<D>,
        saved: SavedPrecision,
    ) -> Tensor<D> {
        if layer.weight.adapter().is_some() {
            return self.linear(layer, relu_squared(u));
        }
        let weight = self.param(&layer.weight, &u);
        let bias = layer.bias.as_ref().map(|bias| self.param(bias, &u));
        relu_squared_linear(u, weight, bias, saved)
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

    /// `norm.forward(x)` through [`crate::ops::rms_norm::rms_norm`]: the same values, with a
    /// backward pass that keeps only the output and one f32 per row (Burn's keeps `x` and
    /// `x / rms`).
    pub fn saving_rms_norm<const D: usize>(&self, norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
        let gamma = self.param(&norm.gamma, &x);
        rms_norm(x, gamma, norm.epsilon)
    }

    /// `norm.forward(x)`: `[..., d_model]` → `[..., d_model]`, Burn's own arithmetic.
    pub fn layer_norm<const D: usize>(&self, norm: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
        // Burn's norm on the routed values: `LayerNorm` keeps its epsilon private, so the norm
        // is a copy (its tensors are handles) holding them.
        let routed = |param: &Param<Tensor<1>>| Param::initialized(param.id, self.param(param, &x));
        let mut norm = norm.clone();
        norm.gamma = routed(&norm.gamma);
        norm.beta = norm.beta.as_ref().map(routed);
        norm.forward(x)
    }

    /// `layer.forward(x)`: Burn's transformer feed-forward `[..., d_model]` → `[..., d_model]`.
    pub fn position_wise_feed_forward<const D: usize>(
        &self,
        layer: &PositionWiseFeedForward,
        x: Tensor<D>,
    ) -> Tensor<D> {
        let x = self.linear(&layer.linear_inner, x);
        let x = layer.dropout.forward(layer.activation.forward(x));
        self.linear(&layer.linear_outer, x)
    }

    /// `layer.forward(input)` with the four linears routed.
    pub fn flash_mha(&self, layer: &FlashMultiHeadAttention, input: FlashMhaInput) -> Tensor<3> {
        layer.forward_routed(input, *self, None)
    }

    /// `encoder.forward(input)` with every linear and layer norm routed.
    pub fn flash_encoder(
        &self,
        encoder: &FlashTransformerEncoder,
        input: FlashTransformerEncoderInput,
    ) -> Tensor<3> {
        encoder.forward_routed(input, *self)
    }

    /// `loss.forward(hidden, head, targets)`, the head's weight and bias routed: an LM head
    /// updated during backward without its logits ever existing.
    ///
    /// # Panics
    /// As [`FusedLinearCrossEntropyLoss::forward`].
    pub fn linear_cross_entropy<const D: usize, const T: usize>(
        &self,
        loss: &FusedLinearCrossEntropyLoss,
        hidden: Tensor<D>,
        head: &Linear,
        targets: Tensor<T, Int>,
    ) -> Tensor<1> {
        loss.try_forward_routed(hidden, head, targets, *self)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// `layer.forward(tokens)`: `[batch, seq]` ids → `[batch, seq, d_model]`. A first layer has
    /// no float input to anchor on, so its weight anchors on itself and is updated last, when
    /// its gradient is complete anyway.
    pub fn embedding(&self, layer: &Embedding, tokens: Tensor<2, Int>) -> Tensor<3> {
        // A leaf: the weight, or for a LoRA-adapted one its first factor (a computed anchor
        // would be a node of the graph that no gradient reaches).
        let anchor = match layer.weight.adapter() {
            Some(adapter) => adapter.a.val(),
            None => layer.weight.val(),
        };
        let weight = self.param(&layer.weight, &anchor);
        // A table kept in host memory (a block not training) is read there: only the rows
        // looked up cross to the device, not the table.
        let device = tokens.device();
        match same_memory(&weight.device(), &device) {
            true => embedding(weight, tokens),
            false => {
                let host = weight.device();
                embedding(weight, tokens.to_device(&host)).to_device(&device)
            }
        }
    }
}
