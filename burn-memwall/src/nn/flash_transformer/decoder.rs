//! Burn's `TransformerDecoder` with its self- and cross-attention on [`FlashMultiHeadAttention`].

use burn::module::Module;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerDecoder, TransformerDecoderConfig, TransformerDecoderLayer,
};
use burn::nn::{Dropout, LayerNorm};
use burn::prelude::*;

use super::{SeenOutput, residual};
use crate::nn::flash_mha::{AttentionMasks, KeyValueCache};
use crate::nn::{FlashMhaInput, FlashMultiHeadAttention, Routed};

/// Drop-in for [`TransformerDecoder`]: the same config ([`TransformerDecoderConfig`]), the same
/// layers with the same parameter paths (`layers.{i}.self_attn.query.weight`,
/// `layers.{i}.cross_attn.…`) and so the same weights and records, the same computation. Only
/// the attention differs, as [`FlashMultiHeadAttention`] says.
///
/// Swapping an existing decoder is one line: `FlashTransformerDecoder::from(decoder)`.
#[derive(Module, Debug)]
pub struct FlashTransformerDecoder {
    /// The layers, Burn's with flash attention.
    pub layers: Vec<FlashTransformerDecoderLayer>,
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

/// [`TransformerDecoderLayer`] with its attention on [`FlashMultiHeadAttention`].
#[derive(Module, Debug)]
pub struct FlashTransformerDecoderLayer {
    /// Attention of the target to the memory.
    pub cross_attn: FlashMultiHeadAttention,
    /// Attention of the target to itself.
    pub self_attn: FlashMultiHeadAttention,
    /// The feed-forward sub-layer.
    pub pwff: PositionWiseFeedForward,
    /// Layer norms: Burn's, in Burn's places.
    pub norm_1: LayerNorm,
    /// See `norm_1`.
    pub norm_2: LayerNorm,
    /// See `norm_1`.
    pub norm_3: LayerNorm,
    /// Dropout of the three residual branches.
    pub dropout: Dropout,
    /// Layer norm before each sub-layer (pre-norm) instead of after.
    pub norm_first: bool,
}

/// The input of [`FlashTransformerDecoder::forward`], built like Burn's
/// `TransformerDecoderInput`, and with the positional options for the target.
#[derive(Debug, Clone)]
pub struct FlashTransformerDecoderInput {
    target: Tensor<3>,
    memory: Tensor<3>,
    /// The target's masks and options, for every layer.
    target_masks: AttentionMasks,
    /// The memory's masks, for every layer.
    memory_masks: AttentionMasks,
}

impl FlashTransformerDecoderInput {
    /// `target` `[batch, s_target, d_model]` attending to itself and to `memory`
    /// `[batch, s_memory, d_model]`.
    pub fn new(target: Tensor<3>, memory: Tensor<3>) -> Self {
        Self {
            target,
            memory,
            target_masks: AttentionMasks::default(),
            memory_masks: AttentionMasks::default(),
        }
    }

    /// `[batch, s_memory]`, true for memory tokens that no target token may see.
    pub fn memory_mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.memory_masks = self.memory_masks.mask_pad(mask_pad);
        self
    }

    /// `[batch, s_target, s_memory]`, true where a target token must not see a memory token.
    pub fn memory_mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.memory_masks = self.memory_masks.mask_attn(mask_attn);
        self
    }

    /// `[batch, s_target]`, true for target tokens that no target token may see.
    pub fn target_mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.target_masks = self.target_masks.mask_pad(mask_pad);
        self
    }

    /// `[batch, s_target, s_target]`, true where a target token must not see another, such as
    /// Burn's `generate_autoregressive_mask`; prefer [`target_causal`](Self::target_causal) to
    /// that one.
    pub fn target_mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.target_masks = self.target_masks.mask_attn(mask_attn);
        self
    }

    /// Each target token sees itself and the target tokens before it.
    pub fn target_causal(mut self) -> Self {
        self.target_masks = self.target_masks.causal();
        self
    }

    /// The masks for the last `new` target tokens, as a step of autoregressive inference
    /// computes them.
    fn last_queries(self, new: usize) -> Self {
        Self {
            target_masks: self.target_masks.last_queries(new),
            memory_masks: self.memory_masks.last_queries(new),
            ..self
        }
    }
}

impl FlashTransformerDecoder {
    /// A fresh decoder initialised exactly as `config.init(device)` initialises Burn's.
    pub fn new(config: &TransformerDecoderConfig, device: &Device) -> Self {
        Self::from(config.init(device))
    }

    /// The target `[batch, s_target, d_model]` → `[batch, s_target, d_model]`.
    ///
    /// # Panics
    /// When the inputs or the masks do not fit the layers, naming the shapes.
    pub fn forward(&self, input: FlashTransformerDecoderInput) -> Tensor<3> {
        self.layers.iter().fold(input.target.clone(), |x, layer| {
            layer.forward(x, &input, None)
        })
    }

    /// Burn's `TransformerDecoder::forward_autoregressive_inference`: `input`'s target holds
    /// the whole sequence so far, with the masks and options [`Self::forward`] would take for
    /// it, and the result is `forward`'s for that sequence. Only the target tokens `cache` has
    /// not seen are computed, attending to the target keys and values it holds; the memory's
    /// keys and values are projected on the first call and reused, as Burn's cache does.
    ///
    /// # Shapes
    /// - target: `[batch, s_target, d_model]`, `s_target` more than the last call's.
    /// - memory: `[batch, s_memory, d_model]`, the same on every call.
    /// - output: `[batch, s_target, d_model]`.
    ///
    /// # Panics
    /// When the target is not longer than the sequence the cache has seen, when its batch
    /// differs from the cache's, or as [`Self::forward`] does.
    pub fn forward_autoregressive_inference(
        &self,
        input: FlashTransformerDecoderInput,
        cache: &mut FlashTransformerDecoderAutoregressiveCache,
    ) -> Tensor<3> {
        let new = cache.seen.new_tokens(input.target.clone());
        let input = input.last_queries(new.dims()[1]);
        let new = self
            .layers
            .iter()
            .zip(&mut cache.layers)
            .fold(new, |x, (layer, cache)| {
                layer.forward(x, &input, Some(cache))
            });
        cache.seen.extend(new)
    }

    /// An empty cache for [`Self::forward_autoregressive_inference`], one per sequence.
    pub fn new_autoregressive_cache(&self) -> FlashTransformerDecoderAutoregressiveCache {
        let layer = || DecoderLayerCache {
            self_attn: KeyValueCache::growing(),
            cross_attn: KeyValueCache::fixed(),
        };
        FlashTransformerDecoderAutoregressiveCache {
            layers: self.layers.iter().map(|_| layer()).collect(),
            seen: SeenOutput::default(),
        }
    }
}

/// What [`FlashTransformerDecoder::forward_autoregressive_inference`] keeps between calls: each
/// layer's key and value heads, of the target and of the memory, and the output so far.
#[derive(Debug)]
pub struct FlashTransformerDecoderAutoregressiveCache {
    layers: Vec<DecoderLayerCache>,
    seen: SeenOutput,
}

/// One decoder layer's key and value heads.
#[derive(Debug)]
struct DecoderLayerCache {
    self_attn: KeyValueCache,
    cross_attn: KeyValueCache,
}

impl FlashTransformerDecoderLayer {
    /// Burn's `TransformerDecoderLayer::forward` on flash attention. With a `cache`, `x` holds
    /// the new target tokens only.
    fn forward(
        &self,
        x: Tensor<3>,
        input: &FlashTransformerDecoderInput,
        cache: Option<&mut DecoderLayerCache>,
    ) -> Tensor<3> {
        // Burn's norms: pre-norm, norm_3, norm_1 and norm_2 before the self-attention, the
        // cross-attention and the feed-forward; post-norm, norm_1, norm_2 and norm_3 after them.
        let [self_norm, cross_norm, ff_norm] = match self.norm_first {
            true => [&self.norm_3, &self.norm_1, &self.norm_2],
            false => [&self.norm_1, &self.norm_2, &self.norm_3],
        };
        // The decoder's parameters are read with `val()`: it is not routed through `InBackward`.
        let plain = Routed::new(None);
        let (self_cache, cross_cache) = match cache {
            Some(cache) => (Some(&mut cache.self_attn), Some(&mut cache.cross_attn)),
            None => (None, None),
        };
        let x = residual(x, self.norm_first, self_norm, &self.dropout, plain, |x| {
            let masks = input.target_masks.clone();
            self.self_attn.self_attention(x, masks, plain, self_cache)
        });
        let x = residual(x, self.norm_first, cross_norm, &self.dropout, plain, |x| {
            let masks = input.memory_masks.clone();
            let memory = input.memory.clone();
            let input = FlashMhaInput::with_masks(x, memory.clone(), memory, masks);
            self.cross_attn.forward_routed(input, plain, cross_cache)
        });
        residual(x, self.norm_first, ff_norm, &self.dropout, plain, |x| {
            self.pwff.forward(x)
        })
    }
}

impl From<TransformerDecoder> for FlashTransformerDecoder {
    /// Keeps every layer's parameters (values and ids) and dropout modules.
    fn from(decoder: TransformerDecoder) -> Self {
        Self {
            layers: decoder.layers.into_iter().map(Into::into).collect(),
            d_model: decoder.d_model,
            d_ff: decoder.d_ff,
            n_heads: decoder.n_heads,
            n_layers: decoder.n_layers,
            dropout: decoder.dropout,
            norm_first: decoder.norm_first,
            quiet_softmax: decoder.quiet_softmax,
        }
    }
}

impl From<TransformerDecoderLayer> for FlashTransformerDecoderLayer {
    fn from(layer: TransformerDecoderLayer) -> Self {
        Self {
            cross_attn: layer.cross_attn.into(),
            self_attn: layer.self_attn.into(),
            pwff: layer.pwff,
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            norm_3: layer.norm_3,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
        }
    }
}
