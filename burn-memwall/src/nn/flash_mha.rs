//! Multi-head attention on [`flash_attention`]: Burn's `MultiHeadAttention` without the
//! `[batch, heads, s_1, s_2]` weights, in the forward pass or the backward.

use burn::module::Module;
use burn::nn::attention::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Dropout, Linear};
use burn::prelude::*;

use super::Routed;
use crate::ops::flash_attention::{AttentionDropout, FlashAttentionOptions, flash_attention};

/// Drop-in for [`MultiHeadAttention`]: the same config ([`MultiHeadAttentionConfig`]), the same
/// four linears and so the same weights and records, the same inputs. What differs:
/// - the forward returns the context `[batch, s_1, d_model]` only; Burn's `MhaOutput` also
///   returns the attention weights, which are exactly the `s_1 × s_2` tensor this layer avoids;
/// - masks are Burn's ([`FlashMhaInput::mask_pad`], [`FlashMhaInput::mask_attn`]), and
///   position can also be given as options that cost nothing to read
///   ([`FlashMhaInput::causal`], [`FlashMhaInput::window`]): prefer `causal()` to an
///   autoregressive `mask_attn`, which is read element by element;
/// - masked keys get exactly zero weight (Burn fills them with `min_float`): results agree
///   whenever a query sees at least one key, and a query that sees none outputs the output
///   layer's bias, where Burn would average every value;
/// - dropout drops the same share of attention weights as Burn's, but draws which ones from
///   flash attention's counter-based generator (seeded from the device's, one seed per
///   forward), not from Burn's `Dropout`: with the same seed the two layers drop different
///   weights.
///
/// Swapping an existing layer is one line: `FlashMultiHeadAttention::from(mha)`.
#[derive(Module, Debug)]
pub struct FlashMultiHeadAttention {
    /// `[d_model] → [d_model]`, split into `n_heads` query heads.
    pub query: Linear,
    /// `[d_model] → [d_model]`, split into `n_heads` key heads.
    pub key: Linear,
    /// `[d_model] → [d_model]`, split into `n_heads` value heads.
    pub value: Linear,
    /// `[d_model] → [d_model]`, applied to the concatenated heads.
    pub output: Linear,
    /// Width of the model.
    pub d_model: usize,
    /// Number of heads.
    pub n_heads: usize,
    /// Dropout of the attention weights, Burn's module (its probability and training flag).
    pub dropout: Dropout,
    /// Burn's quiet softmax (`exp(s_j) / (1 + Σ exp(s_k))`), as the config's `quiet_softmax`.
    pub quiet_softmax: bool,
}

/// The inputs of [`FlashMultiHeadAttention::forward`], built like Burn's `MhaInput`.
#[derive(Debug, Clone)]
pub struct FlashMhaInput {
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    masks: AttentionMasks,
}

impl FlashMhaInput {
    /// Self-attention over `tensor` `[batch, seq, d_model]`.
    pub fn self_attn(tensor: Tensor<3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    /// query `[batch, s_1, d_model]` attending to key and value `[batch, s_2, d_model]`.
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self::with_masks(query, key, value, AttentionMasks::default())
    }

    /// The inputs with `masks`: a transformer layer's input carries its masks to every layer
    /// this way.
    pub(crate) fn with_masks(
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        masks: AttentionMasks,
    ) -> Self {
        Self {
            query,
            key,
            value,
            masks,
        }
    }

    /// `[batch, s_2]`, true for padding keys that no query may see.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.masks = self.masks.mask_pad(mask_pad);
        self
    }

    /// `[batch, s_1, s_2]` (or `[1, s_1, s_2]`), true where a query must not see a key; combined
    /// with [`mask_pad`](Self::mask_pad) when both are given.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.masks = self.masks.mask_attn(mask_attn);
        self
    }

    /// Query `i` sees keys up to `i + s_2 − s_1` (causal, aligned to the end as with a KV cache).
    pub fn causal(mut self) -> Self {
        self.masks = self.masks.causal();
        self
    }

    /// Causal, and only the last `window` keys (sliding-window attention).
    pub fn window(mut self, window: usize) -> Self {
        self.masks = self.masks.window(window);
        self
    }
}

/// The masks and positional options of an attention, apart from its inputs: what a
/// transformer's input carries to each of its layers, documented on [`FlashMhaInput`]'s
/// builders of the same names.
#[derive(Debug, Clone, Default)]
pub(crate) struct AttentionMasks {
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
}

impl AttentionMasks {
    pub(crate) fn mask_pad(self, mask_pad: Tensor<2, Bool>) -> Self {
        Self {
            mask_pad: Some(mask_pad),
            ..self
        }
    }

    pub(crate) fn mask_attn(self, mask_attn: Tensor<3, Bool>) -> Self {
        Self {
            mask_attn: Some(mask_attn),
            ..self
        }
    }

    pub(crate) fn causal(mut self) -> Self {
        self.options.causal = true;
        self
    }

    pub(crate) fn window(mut self, window: usize) -> Self {
        self.options.window = Some(window);
        self
    }

    /// The same masks for the last `new` queries of their sequence, as a step of
    /// autoregressive inference computes them: a `mask_attn` with a row for every query keeps
    /// the last `new`.
    pub(crate) fn last_queries(mut self, new: usize) -> Self {
        self.mask_attn = self.mask_attn.map(|mask| match mask.dims()[1] {
            rows if rows > new => mask.narrow(1, rows - new, new),
            _ => mask,
        });
        self
    }

    /// The one mask [`flash_attention`] reads: `mask_attn`, or the padding `[batch, 1, s_2]`, or
    /// both, hidden where either hides.
    fn mask(self) -> Option<Tensor<3, Bool>> {
        let pad = self.mask_pad.map(|pad| pad.unsqueeze_dim::<3>(1));
        match (pad, self.mask_attn) {
            (Some(pad), Some(attn)) => {
                let [batch, _, s_2] = pad.dims();
                let shape = [batch, attn.dims()[1], s_2];
                Some(pad.expand(shape).bool_or(attn.expand(shape)))
            }
            (pad, attn) => pad.or(attn),
        }
    }
}

impl FlashMultiHeadAttention {
    /// A fresh layer initialised exactly as `config.init(device)` initialises Burn's.
    pub fn new(config: &MultiHeadAttentionConfig, device: &Device) -> Self {
        Self::from(config.init(device))
    }

    /// `[batch, s_1, d_model]` → `[batch, s_1, d_model]`.
    ///
    /// Panics, naming the shapes, when the inputs do not fit the layer or each other.
    pub fn forward(&self, input: FlashMhaInput) -> Tensor<3> {
        self.forward_routed(input, Routed::new(None), None)
    }

    /// Attention of `x` `[batch, seq, d_model]` to itself, under `masks`, as
    /// [`Self::forward_routed`] computes it.
    pub(crate) fn self_attention(
        &self,
        x: Tensor<3>,
        masks: AttentionMasks,
        route: Routed,
        cache: Option<&mut KeyValueCache>,
    ) -> Tensor<3> {
        let input = FlashMhaInput::with_masks(x.clone(), x.clone(), x, masks);
        self.forward_routed(input, route, cache)
    }

    /// [`Self::forward`] with the linears' parameters read through `route`; with a `cache`, the
    /// key and value heads come from it, `input`'s key and value being the new tokens only (see
    /// [`KeyValueCache`]).
    pub(crate) fn forward_routed(
        &self,
        input: FlashMhaInput,
        route: Routed,
        cache: Option<&mut KeyValueCache>,
    ) -> Tensor<3> {
        let [batch, s_1, _] = input.query.dims();
        for (name, t) in [
            ("query", &input.query),
            ("key", &input.key),
            ("value", &input.value),
        ] {
            assert!(
                t.dims()[2] == self.d_model,
                "flash multi-head attention: {name} {:?} must end in d_model = {}",
                t.dims(),
                self.d_model
            );
        }
        let heads = |x: Tensor<3>, linear: &Linear| {
            let [batch, seq, _] = x.dims();
            route
                .linear(linear, x)
                .reshape([batch, seq, self.n_heads, self.d_model / self.n_heads])
                .swap_dims(1, 2)
        };
        // Burn's `Dropout::forward` drops only when training on an autodiff device.
        let device = input.query.device();
        let dropping =
            self.dropout.prob > 0.0 && self.dropout.training.is_enabled() && device.is_autodiff();
        let FlashMhaInput {
            query,
            key,
            value,
            masks,
        } = input;
        let options = FlashAttentionOptions {
            quiet_softmax: self.quiet_softmax,
            dropout: dropping.then(|| AttentionDropout::seeded_by(&device, self.dropout.prob)),
            ..masks.options
        };
        let mask = masks.mask();
        // Query, key, value: Burn's order, in which lazily initialised weights are drawn.
        let query = heads(query, &self.query);
        let project = || (heads(key, &self.key), heads(value, &self.value));
        let (key, value) = match cache {
            Some(cache) => cache.heads(project),
            None => project(),
        };
        let context = flash_attention(query, key, value, mask, options);
        route.linear(
            &self.output,
            context.swap_dims(1, 2).reshape([batch, s_1, self.d_model]),
        )
    }
}

/// The key and value heads one attention layer has projected, `[batch, heads, seen, d_head]`
/// each, kept between the calls of autoregressive inference so that each call projects, and
/// attends from, the new tokens only.
#[derive(Debug)]
pub struct KeyValueCache {
    /// Keys and values come from a memory fixed for the whole sequence (cross-attention): they
    /// are projected on the first call and reused, where self-attention appends each call's.
    fixed: bool,
    heads: Option<(Tensor<4>, Tensor<4>)>,
}

impl KeyValueCache {
    /// For self-attention: each call appends its tokens' keys and values.
    pub fn growing() -> Self {
        Self {
            fixed: false,
            heads: None,
        }
    }

    /// For attention to a memory that stays the same for the whole sequence.
    pub fn fixed() -> Self {
        Self {
            fixed: true,
            heads: None,
        }
    }

    /// The positions whose keys and values the cache holds.
    pub fn seen(&self) -> usize {
        self.heads.as_ref().map_or(0, |(key, _)| key.dims()[2])
    }

    /// Every key and value head so far, `project`ing the new ones (only on the first call of a
    /// fixed cache).
    ///
    /// # Panics
    /// When the new heads' batch differs from the cached ones'.
    pub fn heads(
        &mut self,
        project: impl FnOnce() -> (Tensor<4>, Tensor<4>),
    ) -> (Tensor<4>, Tensor<4>) {
        let heads = match (self.heads.take(), self.fixed) {
            (Some(heads), true) => heads,
            (Some((key, value)), false) => {
                let (new_key, new_value) = project();
                assert!(
                    new_key.dims()[0] == key.dims()[0],
                    "autoregressive inference: a batch of {} sequences, where the cache holds {}",
                    new_key.dims()[0],
                    key.dims()[0]
                );
                (
                    Tensor::cat(vec![key, new_key], 2),
                    Tensor::cat(vec![value, new_value], 2),
                )
            }
            (None, _) => project(),
        };
        self.heads = Some(heads.clone());
        heads
    }
}

impl From<MultiHeadAttention> for FlashMultiHeadAttention {
    /// Keeps the four linears (weights, biases, parameter ids) and the dropout module.
    fn from(mha: MultiHeadAttention) -> Self {
        Self {
            query: mha.query,
            key: mha.key,
            value: mha.value,
            output: mha.output,
            d_model: mha.d_model,
            n_heads: mha.n_heads,
            dropout: mha.dropout,
            quiet_softmax: mha.quiet_softmax,
        }
    }
}
