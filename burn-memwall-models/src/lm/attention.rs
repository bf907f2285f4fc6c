//! Causal grouped-query self-attention with rotary positions, on Burn's attention op or on
//! burn-memwall's flash attention.

use burn::module::Module;
use burn::nn::RotaryEncoding;
use burn::prelude::*;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn_memwall::nn::{KeyValueCache, Routed};
use burn_memwall::ops::flash_attention::{
    FlashAttentionOptions, flash_attention, flash_attention_saving_values,
};
use burn_memwall::ops::rotary::rotary;
use burn_memwall::ops::saved_rows::SavedPrecision;

use super::{AttentionKind, BlockLinear, LmConfig, SaverKind};

/// `softmax(QKᵀ/√d_head + causal mask) V` with `n_kv_heads` key/value heads shared by groups of
/// query heads. With [`AttentionKind::Burn`] the score matrix goes through
/// `burn::tensor::module::attention`, which under autodiff materialises `[batch, heads, seq, seq]`
/// (the baseline); [`AttentionKind::Flash`] never does, and keeps the values for backward as
/// `LmConfig::values_precision` says.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    query: BlockLinear,
    key: BlockLinear,
    value: BlockLinear,
    output: BlockLinear,
    n_heads: usize,
    n_kv_heads: usize,
    #[module(skip)]
    kind: AttentionKind,
    #[module(skip)]
    saved_values: SavedPrecision,
    /// Whether q and k take [`rotary`] (with the saving ops) rather than Burn's encoding.
    #[module(skip)]
    one_pass_rotary: bool,
}

impl CausalSelfAttention {
    pub fn new(config: &LmConfig, device: &Device) -> Self {
        let d = config.d_model;
        let d_kv = config.n_kv_heads * config.d_head();
        let linear = |d_in, d_out| BlockLinear::new(config.linear, d_in, d_out, device);
        Self {
            query: linear(d, d),
            key: linear(d, d_kv),
            value: linear(d, d_kv),
            output: linear(d, d),
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            kind: config.attention,
            saved_values: config.values_precision(),
            one_pass_rotary: config.savers == SaverKind::Exact,
        }
    }

    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding, route: Routed) -> Tensor<3> {
        self.forward_cached(x, rope, route, None)
    }

    /// [`Self::forward`]; with a `cache`, `x` holds the tokens after those the cache has seen,
    /// which attend to the cached keys and values as well as to each other.
    pub(super) fn forward_cached(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        route: Routed,
        cache: Option<&mut KeyValueCache>,
    ) -> Tensor<3> {
        let [batch, seq, d_model] = x.dims();
        let d_head = d_model / self.n_heads;
        let heads = |t: Tensor<3>, n: usize| t.reshape([batch, seq, n, d_head]).swap_dims(1, 2);
        let start = cache.as_ref().map_or(0, |cache| cache.seen());

        // The saving ops turn q and k before they are split into heads, in one pass each way.
        let rotated = |t: Tensor<3>, n: usize| match self.one_pass_rotary {
            true => heads(rotary(t, rope, start), n),
            false => rope.apply(heads(t, n), start),
        };
        let q = rotated(self.query.forward(x.clone(), route), self.n_heads);
        let k = rotated(self.key.forward(x.clone(), route), self.n_kv_heads);
        let v = heads(self.value.forward(x, route), self.n_kv_heads);

        let out = match (self.kind, cache) {
            (AttentionKind::Burn, None) => {
                let options = AttentionModuleOptions {
                    is_causal: true,
                    ..Default::default()
                };
                attention(q, self.repeat_kv(k), self.repeat_kv(v), None, None, options)
            }
            // Generation: the new queries see the cached keys too, causally aligned to the end,
            // which flash attention does for either kind (the kinds differ only in what
            // training keeps).
            (_, cache) => {
                let options = FlashAttentionOptions {
                    causal: true,
                    ..Default::default()
                };
                match cache {
                    Some(cache) => {
                        let (k, v) = cache.heads(|| (k, v));
                        flash_attention(q, k, v, None, options)
                    }
                    None => {
                        flash_attention_saving_values(q, k, v, None, options, self.saved_values)
                    }
                }
            }
        };
        self.output
            .forward(out.swap_dims(1, 2).reshape([batch, seq, d_model]), route)
    }

    /// `[batch, kv_heads, seq, d_head]` → `[batch, heads, seq, d_head]`: Burn's autodiff
    /// attention has no grouped-query support, so each key/value head is repeated for its group.
    fn repeat_kv(&self, t: Tensor<4>) -> Tensor<4> {
        let group = self.n_heads / self.n_kv_heads;
        if group == 1 {
            return t;
        }
        let [batch, kv_heads, seq, d_head] = t.dims();
        t.unsqueeze_dim::<5>(2)
            .expand([batch, kv_heads, group, seq, d_head])
            .reshape([batch, kv_heads * group, seq, d_head])
    }
}
