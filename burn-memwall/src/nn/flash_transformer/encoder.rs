//! Burn's `TransformerEncoder` with its self-attention on [`FlashMultiHeadAttention`].

use burn::module::Module;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerEncoder, TransformerEncoderConfig, TransformerEncoderLayer,
};
use burn::nn::{Dropout, LayerNorm};
use burn::prelude::*;

use super::{SeenOutput, residual};
use crate::nn::flash_mha::KeyValueCache;
use crate::nn::{FlashMhaInput, FlashMultiHeadAttention, Routed};

/// Drop-in for [`TransformerEncoder`]: the same config ([`TransformerEncoderConfig`]), the
/// same layers with the same parameter paths (`layers.{i}.mha.query.weight`, …) and so the same
/// weights and records, the same computation (post- or pre-norm, dropout on both residual
/// branches and on the attention weights). Only the attention differs, as
/// [`FlashMultiHeadAttention`] says: no `[batch, heads, seq, seq]` tensor in the forward pass or
/// the backward, and dropout of the attention weights drawn by flash attention's generator.
///
/// Swapping an existing encoder is one line: `FlashTransformerEncoder::from(encoder)`.
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
    attention: FlashMhaInput,
}

impl FlashTransformerEncoderInput {
    /// `tensor` `[batch, seq, d_model]`, attending to itself.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            attention: FlashMhaInput::self_attn(tensor.clone()),
            tensor,
        }
    }

    /// `[batch, seq]`, true for padding tokens that no token may see.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.attention = self.attention.mask_pad(mask_pad);
        self
    }

    /// `[batch, seq, seq]` (or `[1, seq, seq]`), true where a token must not see another, such
    /// as Burn's `generate_autoregressive_mask`; prefer [`causal`](Self::causal) to that one.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.attention = self.attention.mask_attn(mask_attn);
        self
    }

    /// Each token sees itself and the tokens before it.
    pub fn causal(mut self) -> Self {
        self.attention = self.attention.causal();
        self
    }

    /// Causal, and only the last `window` tokens.
    pub fn window(mut self, window: usize) -> Self {
        self.attention = self.attention.window(window);
        self
    }
}

impl FlashTransformerEncoder {
    /// A fresh encoder initialised exactly as `config.init(device)` initialises Burn's.
    pub fn new(config: &TransformerEncoderConfig, device: &Device) -> Self {
        Self::from(config.init(device))
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
        let FlashTransformerEncoderInput { tensor, attention } = input;
        self.layers.iter().fold(tensor, |x, layer| {
            layer.forward(x, attention.clone(), route, None)
        })
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
        let FlashTransformerEncoderInput { tensor, attention } = input;
        let new = cache.seen.new_tokens(tensor);
        let attention = attention.last_queries(new.dims()[1]);
        let new = self
            .layers
            .iter()
            .zip(&mut cache.layers)
            .fold(new, |x, (layer, cache)| {
                layer.forward(x, attention.clone(), Routed::new(None), Some(cache))
            });
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
    /// Burn's `TransformerEncoderLayer::forward` on flash attention; `attention` carries the
    /// masks and options, its tensors are replaced by the layer's. With a `cache`, `x` holds the
    /// new tokens of the sequence only.
    fn forward(
        &self,
        x: Tensor<3>,
        attention: FlashMhaInput,
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
            |x| {
                let input = attention.with_inputs(x.clone(), x.clone(), x);
                self.mha.forward_routed(input, route, cache)
            },
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
