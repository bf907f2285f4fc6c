//! Burn's `TransformerEncoder` with its self-attention on [`FlashMultiHeadAttention`].

use burn::module::Module;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerEncoder, TransformerEncoderConfig, TransformerEncoderLayer,
};
use burn::nn::{Dropout, LayerNorm};
use burn::prelude::*;

use super::{SeenOutput, residual, reversible};
use crate::nn::flash_mha::{AttentionMasks, KeyValueCache};
use crate::nn::{FlashMultiHeadAttention, Routed};

/// Drop-in for [`TransformerEncoder`]: the same config ([`TransformerEncoderConfig`]), the
/// same layers with the same parameter paths (`layers.{i}.mha.query.weight`, …) and so the same
/// weights and records, the same computation (post- or pre-norm, dropout on both residual
/// branches and on the attention weights). Only the attention differs, as
/// [`FlashMultiHeadAttention`] says: no `[batch, heads, seq, seq]` tensor in the forward pass or
/// the backward, and dropout of the attention weights drawn by flash attention's generator.
///
/// Swapping an existing encoder is one line: `FlashTransformerEncoder::from(encoder)`. One
/// switch more, [`with_reversible`](Self::with_reversible), runs the layers as reversible
/// couplings whose activation memory does not grow with depth.
#[derive(Module, Debug)]
pub struct FlashTransformerEncoder {
    /// The layers, Burn's with flash attention.
    pub layers: Vec<FlashTransformerEncoderLayer>,
    /// Width of the model.
    pub d_model: usize,
    /// Width of the position-wise feed-forward network.
    pub d_ff: usize,
    /// Number of attention heads.
    pub n_heads: usize,
    /// Number of layers.
    pub n_layers: usize,
    /// The dropout probability of every layer.
    pub dropout: f64,
    /// Layer norm before each sub-layer (pre-norm) instead of after.
    pub norm_first: bool,
    /// Burn's quiet softmax in every attention.
    pub quiet_softmax: bool,
    /// Set by [`Self::with_reversible`].
    #[module(skip)]
    reversible: bool,
}

/// [`TransformerEncoderLayer`] with its attention on [`FlashMultiHeadAttention`].
#[derive(Module, Debug)]
pub struct FlashTransformerEncoderLayer {
    /// Self-attention.
    pub mha: FlashMultiHeadAttention,
    /// The feed-forward sub-layer.
    pub pwff: PositionWiseFeedForward,
    /// Layer norm around the feed-forward sub-layer.
    pub norm_1: LayerNorm,
    /// Layer norm around the attention sub-layer.
    pub norm_2: LayerNorm,
    /// Dropout of both residual branches.
    pub dropout: Dropout,
    /// Layer norm before each sub-layer (pre-norm) instead of after.
    pub norm_first: bool,
}

/// The input of [`FlashTransformerEncoder::forward`], built like Burn's
/// `TransformerEncoderInput`, and with the positional options that read nothing per element.
#[derive(Debug, Clone)]
pub struct FlashTransformerEncoderInput {
    tensor: Tensor<3>,
    masks: AttentionMasks,
}

impl FlashTransformerEncoderInput {
    /// `tensor` `[batch, seq, d_model]`, attending to itself.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            tensor,
            masks: AttentionMasks::default(),
        }
    }

    /// `[batch, seq]`, true for padding tokens that no token may see.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.masks = self.masks.mask_pad(mask_pad);
        self
    }

    /// `[batch, seq, seq]` (or `[1, seq, seq]`), true where a token must not see another, such
    /// as Burn's `generate_autoregressive_mask`; prefer [`causal`](Self::causal) to that one.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.masks = self.masks.mask_attn(mask_attn);
        self
    }

    /// Each token sees itself and the tokens before it.
    pub fn causal(mut self) -> Self {
        self.masks = self.masks.causal();
        self
    }

    /// Causal, and only the last `window` tokens.
    pub fn window(mut self, window: usize) -> Self {
        self.masks = self.masks.window(window);
        self
    }
}

impl FlashTransformerEncoder {
    /// A fresh encoder initialised exactly as `config.init(device)` initialises Burn's.
    pub fn new(config: &TransformerEncoderConfig, device: &Device) -> Self {
        Self::from(config.init(device))
    }

    /// With `reversible`, the layers run as additive couplings (RevNet, Reformer), and training
    /// keeps the activations of one layer at a time instead of every layer's. Two streams of
    /// `d_model` both start as the input; each layer computes `y₁ = x₁ + F(x₂)`,
    /// `y₂ = x₂ + G(y₁)` with `F` its pre-norm attention branch `mha(norm_2(·))` and `G` its
    /// feed-forward branch `pwff(norm_1(·))`; the output is the streams' mean. The backward pass
    /// rebuilds each layer's input from its output (`x₂ = y₂ − G(y₁)`, `x₁ = y₁ − F(x₂)`) at the
    /// cost of one more forward pass, on [`ReversibleSequence`](crate::nn::ReversibleSequence).
    ///
    /// The parameters, their paths and the record stay Burn's, but the function is not: a
    /// reversible encoder is a different model from the standard one with the same weights, to
    /// be trained as such (and used as such: the switch is not saved in the record, so set it
    /// again after loading).
    ///
    /// # Panics
    /// With [`ReversibleError`](crate::nn::ReversibleError)'s message when the layers are
    /// post-norm, which is not a coupling, or have dropout, which the backward pass cannot
    /// recompute (and so does each forward pass, should a layer's dropout change since).
    pub fn with_reversible(mut self, reversible: bool) -> Self {
        if let Some(error) = reversible
            .then(|| reversible::refusal(&self.layers))
            .flatten()
        {
            panic!("{error}");
        }
        self.reversible = reversible;
        self
    }

    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    ///
    /// # Panics
    /// When the input or the masks do not fit the layers, naming the shapes.
    pub fn forward(&self, input: FlashTransformerEncoderInput) -> Tensor<3> {
        self.forward_routed(input, Routed::new(None))
    }

    /// [`Self::forward`] with every parameter read through `route`.
    pub(crate) fn forward_routed(
        &self,
        input: FlashTransformerEncoderInput,
        route: Routed,
    ) -> Tensor<3> {
        let FlashTransformerEncoderInput { tensor, masks } = input;
        match self.reversible {
            true => reversible::forward(&self.layers, tensor, masks, route),
            false => self.layers.iter().fold(tensor, |x, layer| {
                layer.forward(x, masks.clone(), route, None)
            }),
        }
    }

    /// Burn's `TransformerEncoder::forward_autoregressive_inference`: `input` holds the whole
    /// sequence so far, with the masks and options [`Self::forward`] would take for it, and the
    /// result is `forward`'s for that sequence. Only the tokens `cache` has not seen are
    /// computed, attending to the keys and values it holds: one token per call costs
    /// `O(seq · d_model)` per layer, where Burn's recomputes every query's attention weights.
    ///
    /// # Shapes
    /// - `input`: `[batch, seq, d_model]`, `seq` more than the last call's.
    /// - output: `[batch, seq, d_model]`.
    ///
    /// # Panics
    /// When `input` is not longer than the sequence the cache has seen, when its batch differs
    /// from the cache's, or as [`Self::forward`] does.
    pub fn forward_autoregressive_inference(
        &self,
        input: FlashTransformerEncoderInput,
        cache: &mut FlashTransformerEncoderAutoregressiveCache,
    ) -> Tensor<3> {
        let FlashTransformerEncoderInput { tensor, masks } = input;
        let new = cache.seen.new_tokens(tensor);
        let masks = masks.last_queries(new.dims()[1]);
        let new = match self.reversible {
            true => reversible::forward_cached(&self.layers, new, masks, &mut cache.layers),
            false => self
                .layers
                .iter()
                .zip(&mut cache.layers)
                .fold(new, |x, (layer, cache)| {
                    layer.forward(x, masks.clone(), Routed::new(None), Some(cache))
                }),
        };
        cache.seen.extend(new)
    }

    /// An empty cache for [`Self::forward_autoregressive_inference`], one per sequence.
    pub fn new_autoregressive_cache(&self) -> FlashTransformerEncoderAutoregressiveCache {
        FlashTransformerEncoderAutoregressiveCache {
            layers: self
                .layers
                .iter()
                .map(|_| KeyValueCache::growing())
                .collect(),
            seen: SeenOutput::default(),
        }
    }
}

/// What [`FlashTransformerEncoder::forward_autoregressive_inference`] keeps between calls: each
/// layer's key and value heads, and the output so far.
#[derive(Debug)]
pub struct FlashTransformerEncoderAutoregressiveCache {
    layers: Vec<KeyValueCache>,
    seen: SeenOutput,
}

impl FlashTransformerEncoderLayer {
    /// Burn's `TransformerEncoderLayer::forward` on flash attention. With a `cache`, `x` holds
    /// the new tokens of the sequence only.
    fn forward(
        &self,
        x: Tensor<3>,
        masks: AttentionMasks,
        route: Routed,
        cache: Option<&mut KeyValueCache>,
    ) -> Tensor<3> {
        // Burn's norms: pre-norm, norm_2 before the attention and norm_1 before the
        // feed-forward; post-norm, norm_1 after the attention and norm_2 after the feed-forward.
        let (attention_norm, ff_norm) = match self.norm_first {
            true => (&self.norm_2, &self.norm_1),
            false => (&self.norm_1, &self.norm_2),
        };
        let x = residual(
            x,
            self.norm_first,
            attention_norm,
            &self.dropout,
            route,
            |x| self.mha.self_attention(x, masks, route, cache),
        );
        residual(x, self.norm_first, ff_norm, &self.dropout, route, |x| {
            route.position_wise_feed_forward(&self.pwff, x)
        })
    }
}

impl From<TransformerEncoder> for FlashTransformerEncoder {
    /// Keeps every layer's parameters (values and ids) and dropout modules.
    fn from(encoder: TransformerEncoder) -> Self {
        Self {
            layers: encoder.layers.into_iter().map(Into::into).collect(),
            d_model: encoder.d_model,
            d_ff: encoder.d_ff,
            n_heads: encoder.n_heads,
            n_layers: encoder.n_layers,
            dropout: encoder.dropout,
            norm_first: encoder.norm_first,
            quiet_softmax: encoder.quiet_softmax,
            reversible: false,
        }
    }
}

impl From<TransformerEncoderLayer> for FlashTransformerEncoderLayer {
    fn from(layer: TransformerEncoderLayer) -> Self {
        Self {
            mha: layer.mha.into(),
            pwff: layer.pwff,
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
        }
    }
}
