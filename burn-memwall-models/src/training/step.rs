//! How the Learner trains and validates the language model, and the metrics it records.

use std::sync::Arc;

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer, MultiGradientsParams};
use burn::prelude::*;
use burn::tensor::{ExecutionError, TensorReadError};
use burn::train::metric::{
    Adaptor, LossInput, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric,
    NumericAttributes, NumericEntry, SerializedEntry,
};
use burn::train::{InferenceStep, ItemLazy, TrainOutput, TrainStep};

use crate::data::LmBatch;
use crate::lm::LanguageModel;

/// What one step hands to the metrics: only the mean loss. Burn's `SequenceOutput` would keep
/// the `[batch, seq, vocab]` logits alive until the metric thread has read them.
#[derive(Clone, Debug)]
pub struct LmOutput {
    /// Mean next-token cross-entropy of the batch, `[1]`.
    pub loss: Tensor<1>,
    /// Target tokens the mean is over.
    pub tokens: usize,
}

impl ItemLazy for LmOutput {
    /// Reads the loss to the host: the metrics then read a host copy on their own thread and
    /// never touch the device from there (on a Cube device, a thread that reads opens a stream
    /// whose memory pools are its own).
    fn sync(self) -> Result<Self, ExecutionError> {
        let loss = self.loss.without_autodiff().try_into_data()?;
        Ok(Self {
            loss: Tensor::from_data(loss, &Device::flex()),
            tokens: self.tokens,
        })
    }
}

impl Adaptor<LossInput> for LmOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

impl TrainStep for LanguageModel {
    type Input = LmBatch;
    type Output = LmOutput;

    fn step(&self, batch: LmBatch) -> TrainOutput<LmOutput> {
        let tokens = batch.targets.shape().num_elements();
        let loss = self.loss(batch.inputs, batch.targets);
        let output = LmOutput {
            loss: loss.clone(),
            tokens,
        };
        let loss = self.backward_loss(loss);
        match self.in_backward() {
            // The backward pass runs in `optimize`, where the optimizer is at hand.
            Some(in_backward) => {
                in_backward
                    .defer(loss)
                    .unwrap_or_else(|error| panic!("{error}"));
                TrainOutput {
                    grads: GradientsParams::new(),
                    item: output,
                }
            }
            None => TrainOutput::new(self, loss.backward(), output),
        }
    }

    fn optimize(
        self,
        optimizer: &mut ModuleOptimizer,
        learning_rate: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let stepped = match self.in_backward().cloned() {
            Some(in_backward) => in_backward
                .step_deferred(optimizer, learning_rate, self)
                .unwrap_or_else(|error| panic!("{error}")),
            None => optimizer.step(learning_rate, self, grads),
        };
        stepped.end_step();
        stepped
    }

    fn optimize_multi(
        self,
        optimizer: &mut ModuleOptimizer,
        learning_rate: ModuleLearningRate,
        grads: MultiGradientsParams,
    ) -> Self {
        assert!(
            self.in_backward().is_none(),
            "in-backward updates cannot train on several devices: each device would update its \
             own copy from its own gradients, which are never summed; train on one device"
        );
        let stepped = optimizer.step_multi(learning_rate, self, grads);
        stepped.end_step();
        stepped
    }
}

impl InferenceStep for LanguageModel {
    type Input = LmBatch;
    type Output = LmOutput;

    fn step(&self, batch: LmBatch) -> LmOutput {
        let tokens = batch.targets.shape().num_elements();
        LmOutput {
            loss: self.loss(batch.inputs, batch.targets),
            tokens,
        }
    }
}

/// A batch's mean loss and the number of tokens it averages.
pub struct MeanLoss {
    loss: Tensor<1>,
    tokens: usize,
}

impl Adaptor<MeanLoss> for LmOutput {
    fn adapt(&self) -> MeanLoss {
        MeanLoss {
            loss: self.loss.clone(),
            tokens: self.tokens,
        }
    }
}

/// `exp(token-weighted mean loss)` over the epoch: the perplexity, computed from the loss the
/// step already has instead of from full logits (which Burn's `PerplexityMetric` needs).
#[derive(Clone)]
pub struct PerplexityFromLoss {
    name: MetricName,
    loss_sum: f64,
    tokens: usize,
    last: f64,
}

impl Default for PerplexityFromLoss {
    fn default() -> Self {
        Self {
            name: Arc::new("Perplexity".into()),
            loss_sum: 0.0,
            tokens: 0,
            last: f64::NAN,
        }
    }
}

impl PerplexityFromLoss {
    fn epoch_value(&self) -> f64 {
        (self.loss_sum / self.tokens.max(1) as f64).exp()
    }
}

impl Metric for PerplexityFromLoss {
    type Input = MeanLoss;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }

    fn update(
        &mut self,
        input: &MeanLoss,
        _: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let loss = input.loss.clone().try_into_scalar::<f64>()?;
        self.loss_sum += loss * input.tokens as f64;
        self.tokens += input.tokens;
        self.last = loss.exp();
        Ok(SerializedEntry::new(
            format!("epoch {:.3} - batch {:.3}", self.epoch_value(), self.last),
            NumericEntry::Aggregated {
                aggregated_value: self.last,
                count: 1,
            }
            .serialize(),
        ))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        let value = self.epoch_value();
        Ok(SerializedEntry::new(
            format!("{value:.3}"),
            NumericEntry::Final(value).serialize(),
        ))
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

impl Numeric for PerplexityFromLoss {
    fn value(&self) -> Option<NumericEntry> {
        Some(NumericEntry::Aggregated {
            aggregated_value: self.last,
            count: 1,
        })
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(NumericEntry::Aggregated {
            aggregated_value: self.epoch_value(),
            count: self.tokens,
        })
    }

    fn final_value(&self) -> NumericEntry {
        NumericEntry::Final(self.epoch_value())
    }
}
