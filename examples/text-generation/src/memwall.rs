//! `model.rs` after the swap to burn-memwall (the README shows the diff): the encoder on flash
//! attention with causality as an option instead of a mask, the head's loss fused so that no
//! logits exist, and every parameter updated during backward, its gradient freed at once; and,
//! for generation, the flash encoder's autoregressive cache.

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::train::{InferenceStep, TrainOutput, TrainStep};
use burn_memwall::nn::{
    FlashTransformerEncoder, FlashTransformerEncoderAutoregressiveCache,
    FlashTransformerEncoderInput, FusedLinearCrossEntropyLossConfig, Routed,
};
use burn_memwall::optim::InBackward;

use crate::data::TrainingTextGenerationBatch;
use crate::output::LossOutput;

#[derive(Config, Debug)]
pub struct TextGenerationModelConfig {
    transformer: TransformerEncoderConfig,
    vocab_size: usize,
    pad_token: usize,
    max_seq_length: usize,
    #[config(default = false)]
    reversible: bool,
}

#[derive(Module, Debug)]
pub struct TextGenerationModel {
    transformer: FlashTransformerEncoder,
    embedding_token: Embedding,
    embedding_pos: Embedding,
    output: Linear,
    vocab_size: usize,
    pad_token: usize,
    max_seq_length: usize,
    #[module(skip)]
    in_backward: InBackward,
}

impl TextGenerationModelConfig {
    pub fn init(&self, device: &Device) -> TextGenerationModel {
        let transformer = FlashTransformerEncoder::new(&self.transformer, device)
            .with_reversible(self.reversible);
        let embedding_token =
            EmbeddingConfig::new(self.vocab_size, self.transformer.d_model).init(device);
        let embedding_pos =
            EmbeddingConfig::new(self.max_seq_length, self.transformer.d_model).init(device);
        let output = LinearConfig::new(self.transformer.d_model, self.vocab_size).init(device);

        TextGenerationModel {
            transformer,
            embedding_token,
            embedding_pos,
            output,
            vocab_size: self.vocab_size,
            pad_token: self.pad_token,
            max_seq_length: self.max_seq_length,
            in_backward: InBackward::new(),
        }
    }
}

impl TextGenerationModel {
    pub fn in_backward(&self) -> &InBackward {
        &self.in_backward
    }

    pub fn forward_training(&self, item: TrainingTextGenerationBatch) -> LossOutput {
        let route = Routed::new(Some(&self.in_backward));
        let [batch_size, seq_length] = item.tokens_inputs.dims();
        let device = &self.devices()[0];

        let inputs = item.tokens_inputs.to_device(device);
        let targets = item.targets.to_device(device);
        let mask_pad = item.mask_pad.to_device(device);

        let index_positions = Tensor::arange(0..seq_length as i64, device)
            .reshape([1, seq_length])
            .repeat_dim(0, batch_size);
        let embedding_positions = route.embedding(&self.embedding_pos, index_positions);
        let embedding_tokens = route.embedding(&self.embedding_token, inputs);
        let embedding = (embedding_positions + embedding_tokens) / 2;

        let encoded = route.flash_encoder(
            &self.transformer,
            FlashTransformerEncoderInput::new(embedding)
                .mask_pad(mask_pad)
                .causal(),
        );

        let loss = FusedLinearCrossEntropyLossConfig::new()
            .with_ignore_index(Some(self.pad_token))
            .init();
        let loss = route.linear_cross_entropy(&loss, encoded, &self.output, targets);

        LossOutput { loss }
    }

    /// The logits `[batch, vocab]` of the token after `tokens` `[batch, seq]`, the whole
    /// sequence so far; the encoder computes only what `cache` has not seen.
    pub fn forward_next_token(
        &self,
        tokens: Tensor<2, Int>,
        cache: &mut FlashTransformerEncoderAutoregressiveCache,
    ) -> Tensor<2> {
        let [batch_size, seq_length] = tokens.dims();
        let device = &self.devices()[0];

        let index_positions = Tensor::arange(0..seq_length as i64, device)
            .reshape([1, seq_length])
            .repeat_dim(0, batch_size);
        let embedding_positions = self.embedding_pos.forward(index_positions);
        let embedding_tokens = self.embedding_token.forward(tokens.to_device(device));
        let embedding = (embedding_positions + embedding_tokens) / 2;

        let encoded = self.transformer.forward_autoregressive_inference(
            FlashTransformerEncoderInput::new(embedding).causal(),
            cache,
        );

        let last = encoded.narrow(1, seq_length - 1, 1).squeeze_dim(1);
        self.output.forward(last)
    }

    pub fn new_autoregressive_cache(&self) -> FlashTransformerEncoderAutoregressiveCache {
        self.transformer.new_autoregressive_cache()
    }
}

impl TrainStep for TextGenerationModel {
    type Input = TrainingTextGenerationBatch;
    type Output = LossOutput;

    fn step(&self, item: TrainingTextGenerationBatch) -> TrainOutput<LossOutput> {
        let item = self.forward_training(item);
        // The backward pass runs in `optimize`, where the optimizer is at hand.
        self.in_backward
            .defer(item.loss.clone())
            .unwrap_or_else(|error| panic!("{error}"));

        TrainOutput {
            grads: GradientsParams::new(),
            item,
        }
    }

    fn optimize(
        self,
        optimizer: &mut ModuleOptimizer,
        learning_rate: ModuleLearningRate,
        _grads: GradientsParams,
    ) -> Self {
        self.in_backward
            .clone()
            .step_deferred(optimizer, learning_rate, self)
            .unwrap_or_else(|error| panic!("{error}"))
    }
}

impl InferenceStep for TextGenerationModel {
    type Input = TrainingTextGenerationBatch;
    type Output = LossOutput;

    fn step(&self, item: TrainingTextGenerationBatch) -> LossOutput {
        self.forward_training(item)
    }
}
