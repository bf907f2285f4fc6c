//! The decoder-only language model.

use burn::module::{Initializer, Module, ParamGroup};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::prelude::*;

use burn_memwall::nn::{
    CounterEmbedding, CounterLinear, CouplingFunction, FusedLinearCrossEntropyLossConfig,
    KeyValueCache, ReversibleSequence, Routed,
};
use burn_memwall::optim::{InBackward, LossScale};

use super::{
    AttentionCoupling, BlockKind, CausalSelfAttention, LinearKind, LmConfig, LossKind, Mlp,
    MlpCoupling, SaverKind, counter_config, reversible_blocks,
};
use crate::Error;

/// One pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Module, Debug)]
pub struct Block {
    attention_norm: RmsNorm,
    attention: CausalSelfAttention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
    #[module(skip)]
    savers: SaverKind,
}

impl Block {
    fn new(config: &LmConfig, device: &Device) -> Self {
        let norm = || {
            RmsNormConfig::new(config.d_model)
                .with_epsilon(config.norm_eps)
                .init(device)
        };
        Self {
            attention_norm: norm(),
            attention: CausalSelfAttention::new(config, device),
            mlp_norm: norm(),
            mlp: Mlp::new(config, device),
            savers: config.savers,
        }
    }

    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding, route: Routed) -> Tensor<3> {
        self.forward_cached(x, rope, route, None)
    }

    /// [`Self::forward`]; with a `cache`, `x` holds the tokens after those it has seen.
    fn forward_cached(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        route: Routed,
        cache: Option<&mut KeyValueCache>,
    ) -> Tensor<3> {
        let normed = rms_norm(self.savers, route, &self.attention_norm, x.clone());
        let x = x + self.attention.forward_cached(normed, rope, route, cache);
        let normed = rms_norm(self.savers, route, &self.mlp_norm, x.clone());
        x + self.mlp.forward(normed, route)
    }
}

/// `norm.forward(x)` through `route`, keeping for backward what `savers` says.
pub(super) fn rms_norm<const D: usize>(
    savers: SaverKind,
    route: Routed,
    norm: &RmsNorm,
    x: Tensor<D>,
) -> Tensor<D> {
    match savers {
        SaverKind::Burn => route.rms_norm(norm, x),
        SaverKind::Exact => route.saving_rms_norm(norm, x),
    }
}

/// Token embedding → blocks → RMSNorm → LM head (tied to the embedding or its own `Linear`).
/// With [`LinearKind::CounterAll`] the embedding and the head are counter codes, in
/// `coded_embedding` and `coded_head`; otherwise they are Burn's layers, in `embedding` and
/// `head` (the record's names do not depend on the other switches).
#[derive(Module, Debug)]
pub struct LanguageModel {
    embedding: Option<Embedding>,
    coded_embedding: Option<CounterEmbedding>,
    /// The standard blocks (none when the blocks are reversible).
    blocks: Vec<Block>,
    /// The reversible blocks, for [`BlockKind::Reversible`]: two streams of `d_model` each.
    reversible: Option<ReversibleSequence<AttentionCoupling, MlpCoupling>>,
    norm: RmsNorm,
    head: Option<Linear>,
    coded_head: Option<CounterLinear>,
    rope: RotaryEncoding,
    vocab_size: usize,
    max_seq_len: usize,
    #[module(skip)]
    loss: LossKind,
    #[module(skip)]
    savers: SaverKind,
    /// Set by [`LanguageModel::with_in_backward`]: every parameter is then updated during
    /// backward by [`InBackward::step`].
    #[module(skip)]
    in_backward: Option<InBackward>,
    /// Set by [`LanguageModel::with_loss_scale`]: the training step's backward pass then starts
    /// from the scaled loss.
    #[module(skip)]
    loss_scale: Option<LossScale>,
}

impl LmConfig {
    /// Builds the model on `device` after checking the config.
    pub fn init(&self, device: &Device) -> Result<LanguageModel, Error> {
        self.validate()?;
        let embedding = EmbeddingConfig::new(self.vocab_size, self.d_model)
            .with_initializer(Initializer::Normal {
                mean: 0.0,
                std: 0.02,
            })
            .init(device);
        let head = (!self.tie_embeddings).then(|| {
            LinearConfig::new(self.d_model, self.vocab_size)
                .with_bias(false)
                .init(device)
        });
        let config = counter_config(self.d_model, self.vocab_size);
        let (embedding, coded_embedding, head, coded_head) =
            if self.linear == LinearKind::CounterAll {
                let coded_embedding = CounterEmbedding::from_embedding(embedding, &config);
                let coded_head = head.map(|head| config.init_from_linear(head));
                (None, Some(coded_embedding), None, coded_head)
            } else {
                (Some(embedding), None, head, None)
            };
        Ok(LanguageModel {
            embedding,
            coded_embedding,
            blocks: match self.blocks {
                BlockKind::Standard => (0..self.n_layers)
                    .map(|_| Block::new(self, device))
                    .collect(),
                BlockKind::Reversible => Vec::new(),
            },
            reversible: (self.blocks == BlockKind::Reversible)
                .then(|| reversible_blocks(self, device)),
            norm: RmsNormConfig::new(self.d_model)
                .with_epsilon(self.norm_eps)
                .init(device),
            head,
            coded_head,
            rope: RotaryEncodingConfig::new(self.max_seq_len, self.d_head())
                .with_theta(self.rope_theta)
                .init(device),
            vocab_size: self.vocab_size,
            max_seq_len: self.max_seq_len,
            loss: self.loss,
            savers: self.savers,
            in_backward: None,
            loss_scale: None,
        })
    }
}

impl LmConfig {
    /// The model's blocks for block-coordinate training ([`burn_memwall::optim::BlockCoordinate`]),
    /// from the input up: the token table (with the final norm when the head is the table),
    /// each layer, then the final norm and the head (when the head is its own). Every
    /// parameter is in exactly one.
    pub fn coordinate_blocks(&self) -> Vec<ParamGroup> {
        let group = |pattern: String| {
            ParamGroup::from_regex(&pattern).expect("the model's own path patterns are valid")
        };
        let layer = |i: usize| match self.blocks {
            BlockKind::Standard => format!(r"^blocks\.{i}\."),
            BlockKind::Reversible => format!(r"^reversible\.[fg]\.{i}\."),
        };
        let table = match self.tie_embeddings {
            true => r"^(embedding|coded_embedding|norm)\.",
            false => r"^(embedding|coded_embedding)\.",
        };
        let head = (!self.tie_embeddings).then(|| group(r"^(norm|head|coded_head)\.".into()));
        std::iter::once(group(table.into()))
            .chain((0..self.n_layers).map(|i| group(layer(i))))
            .chain(head)
            .collect()
    }

    /// The parameters block-coordinate training keeps on the device while their block waits:
    /// a token table tied to the head, which the first layer and the loss both read.
    pub fn coordinate_pinned(&self) -> Option<ParamGroup> {
        self.tie_embeddings.then(|| {
            ParamGroup::from_regex(r"^(embedding|coded_embedding)\.")
                .expect("the model's own path patterns are valid")
        })
    }
}

impl LanguageModel {
    /// Ids the embedding and head cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Longest sequence the model accepts.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Routes every parameter through `in_backward` (or back to plain reads with `None`), so
    /// that training with [`InBackward::step`] updates each one during backward.
    pub fn with_in_backward(mut self, in_backward: Option<InBackward>) -> Self {
        self.reversible = self
            .reversible
            .map(|blocks| blocks.with_in_backward(in_backward.clone()));
        self.in_backward = in_backward;
        self
    }

    /// The handle set by [`Self::with_in_backward`].
    pub fn in_backward(&self) -> Option<&InBackward> {
        self.in_backward.as_ref()
    }

    /// Trains on losses scaled by `loss_scale` (f16's gradients), or unscaled with `None`; the
    /// optimizer must unscale them ([`burn_memwall::optim::LossScaled`] with the same scale).
    pub fn with_loss_scale(mut self, loss_scale: Option<LossScale>) -> Self {
        self.loss_scale = loss_scale;
        self
    }

    /// The loss a training step's backward pass starts from: `loss`, scaled by the scale set
    /// with [`Self::with_loss_scale`].
    pub fn backward_loss(&self, loss: Tensor<1>) -> Tensor<1> {
        match &self.loss_scale {
            Some(scale) => scale.scale(loss),
            None => loss,
        }
    }

    /// Ends a training step after its update: the loss scale, if one is set, reads whether an
    /// update overflowed.
    pub fn end_step(&self) {
        if let Some(scale) = &self.loss_scale {
            scale.end_step();
        }
    }

    fn route(&self) -> Routed<'_> {
        Routed::new(self.in_backward.as_ref())
    }

    /// `[batch, seq]` token ids → `[batch, seq, d_model]` final hidden states (after the norm).
    pub fn hidden(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [_, seq] = tokens.dims();
        self.check_length(seq);
        let route = self.route();
        let x = self.embed(tokens, route);
        let x = match &self.reversible {
            // Both streams start as the embedding; the final norm reads their mean.
            Some(reversible) => {
                let streams = reversible.forward(Tensor::cat(vec![x.clone(), x], 2));
                mean_of_streams(
                    <[Tensor<3>; 2]>::try_from(streams.chunk(2, 2))
                        .expect("the blocks return both streams"),
                )
            }
            None => self
                .blocks
                .iter()
                .fold(x, |x, block| block.forward(x, &self.rope, route)),
        };
        rms_norm(self.savers, route, &self.norm, x)
    }

    /// `[batch, seq]` token ids → `[batch, seq, vocab]` logits.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.logits(self.hidden(tokens))
    }

    /// An empty cache for [`Self::next_logits`], one per batch of sequences.
    pub fn new_generation_cache(&self) -> GenerationCache {
        let layers = match &self.reversible {
            Some(reversible) => reversible.len(),
            None => self.blocks.len(),
        };
        GenerationCache {
            layers: (0..layers).map(|_| KeyValueCache::growing()).collect(),
        }
    }

    /// The logits `[batch, vocab]` of the token that follows `tokens` `[batch, new]`, which
    /// continue the sequence `cache` has seen (the prompt on the first call, then each chosen
    /// token). Only the new tokens are computed, attending to every key and value the cache
    /// holds; [`Self::forward`] of the whole sequence gives the same logits at its last
    /// position.
    ///
    /// # Panics
    /// When the sequence would exceed `max_seq_len`, or `tokens` holds no token.
    pub fn next_logits(&self, tokens: Tensor<2, Int>, cache: &mut GenerationCache) -> Tensor<2> {
        let [_, new] = tokens.dims();
        assert!(new > 0, "generation: no new token to compute");
        self.check_length(cache.seen() + new);
        let route = self.route();
        let x = self.embed(tokens, route);
        let caches = cache.layers.iter_mut();
        let x = match &self.reversible {
            Some(reversible) => {
                let couplings = reversible.f.iter().zip(&reversible.g).zip(caches);
                let [first, second] =
                    couplings.fold([x.clone(), x], |[x1, x2], ((f, g), cache)| {
                        let y1 = x1 + f.forward_cached(x2.clone(), Some(cache));
                        let y2 = x2 + g.forward(y1.clone());
                        [y1, y2]
                    });
                mean_of_streams([first, second])
            }
            None => self.blocks.iter().zip(caches).fold(x, |x, (block, cache)| {
                block.forward_cached(x, &self.rope, route, Some(cache))
            }),
        };
        let last = route.rms_norm(&self.norm, x.narrow(1, new - 1, 1));
        self.logits(last).squeeze_dim(1)
    }

    /// # Panics
    /// With [`Error::SequenceTooLong`] when `seq` exceeds `max_seq_len`.
    fn check_length(&self, seq: usize) {
        assert!(
            seq <= self.max_seq_len,
            "{}",
            Error::SequenceTooLong {
                seq_len: seq,
                max_seq_len: self.max_seq_len
            }
        );
    }

    /// `[batch, seq]` token ids → `[batch, seq, d_model]` embeddings.
    fn embed(&self, tokens: Tensor<2, Int>, route: Routed) -> Tensor<3> {
        match self.table() {
            Table::Dense(embedding) => route.embedding(embedding, tokens),
            Table::Coded(embedding) => route.counter_embedding(embedding, tokens),
        }
    }

    /// `[batch, seq, d_model]` final hidden states → `[batch, seq, vocab]` logits.
    fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        let route = self.route();
        match self.head() {
            Head::Linear(head) => route.linear(head, hidden),
            Head::Counter(head) => route.counter_linear(head, hidden),
            Head::TiedEmbedding(embedding) => {
                let weight = route.param(&embedding.weight, &hidden);
                hidden.matmul(weight.transpose().unsqueeze())
            }
            Head::TiedCounter(embedding) => {
                embedding.weights.forward(hidden, self.in_backward.as_ref())
            }
        }
    }

    fn table(&self) -> Table<'_> {
        match (&self.embedding, &self.coded_embedding) {
            (Some(embedding), _) => Table::Dense(embedding),
            (None, Some(embedding)) => Table::Coded(embedding),
            (None, None) => unreachable!("a model has a token embedding"),
        }
    }

    fn head(&self) -> Head<'_> {
        match (&self.head, &self.coded_head, self.table()) {
            (Some(head), _, _) => Head::Linear(head),
            (None, Some(head), _) => Head::Counter(head),
            (None, None, Table::Dense(embedding)) => Head::TiedEmbedding(embedding),
            (None, None, Table::Coded(embedding)) => Head::TiedCounter(embedding),
        }
    }

    /// Mean next-token cross-entropy over every position: `[batch, seq]` ids and targets →
    /// `[1]`. With [`LossKind::Burn`] from the full `[batch · seq, vocab]` logits (the
    /// baseline); with [`LossKind::Fused`] chunk by chunk, never holding the logits (and, for a
    /// counter head, block by block of the vocabulary, never holding its weight's gradient).
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        match self.loss {
            LossKind::Burn => {
                let logits = self.forward(tokens);
                let [batch, seq, vocab] = logits.dims();
                let loss = CrossEntropyLossConfig::new().init(&logits.device());
                loss.forward(
                    logits.reshape([batch * seq, vocab]),
                    targets.reshape([batch * seq]),
                )
            }
            LossKind::Fused => {
                let hidden = self.hidden(tokens);
                let loss = FusedLinearCrossEntropyLossConfig::new().init();
                let route = self.route();
                let in_backward = self.in_backward.as_ref();
                // The op reads `[vocab, d_model]`: a tied head's is the embedding itself (a
                // `Linear`'s is transposed by `linear_cross_entropy`).
                match self.head() {
                    Head::Linear(head) => {
                        Ok(route.linear_cross_entropy(&loss, hidden, head, targets))
                    }
                    Head::TiedEmbedding(embedding) => loss.try_forward_weights(
                        hidden.clone(),
                        route.param(&embedding.weight, &hidden),
                        None,
                        targets,
                    ),
                    Head::Counter(head) => {
                        loss.try_forward_counter(hidden, &head.weights, targets, in_backward)
                    }
                    Head::TiedCounter(embedding) => {
                        loss.try_forward_counter(hidden, &embedding.weights, targets, in_backward)
                    }
                }
                .unwrap_or_else(|error| panic!("{error}"))
            }
        }
    }
}

/// What [`LanguageModel::next_logits`] keeps between calls: each block's keys and values.
#[derive(Debug)]
pub struct GenerationCache {
    layers: Vec<KeyValueCache>,
}

impl GenerationCache {
    /// The positions of the sequence seen so far.
    pub fn seen(&self) -> usize {
        self.layers.first().map_or(0, KeyValueCache::seen)
    }
}

/// The mean of the two streams of reversible blocks.
fn mean_of_streams([first, second]: [Tensor<3>; 2]) -> Tensor<3> {
    (first + second) * 0.5
}

/// The token table.
enum Table<'a> {
    Dense(&'a Embedding),
    Coded(&'a CounterEmbedding),
}

/// Where the logits' weight is.
enum Head<'a> {
    Linear(&'a Linear),
    Counter(&'a CounterLinear),
    TiedEmbedding(&'a Embedding),
    TiedCounter(&'a CounterEmbedding),
}
