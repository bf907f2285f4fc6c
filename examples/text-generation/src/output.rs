//! What a burn-memwall step hands to the metrics: the loss alone, since no logits exist to hand
//! over (Burn's `ClassificationOutput` carries the `[tokens, vocab]` logits for accuracy).

use burn::prelude::*;
use burn::tensor::ExecutionError;
use burn::train::ItemLazy;
use burn::train::metric::{Adaptor, LossInput};

/// The mean loss of a batch, `[1]`.
#[derive(Clone, Debug)]
pub struct LossOutput {
    /// Mean next-token cross-entropy over the batch's targets that are not padding.
    pub loss: Tensor<1>,
}

impl ItemLazy for LossOutput {
    /// As Burn's `ClassificationOutput`: off the autodiff graph, the device's queued work
    /// flushed, nothing read back.
    fn sync(self) -> Result<Self, ExecutionError> {
        self.loss.device().flush()?;
        Ok(Self {
            loss: self.loss.without_autodiff(),
        })
    }
}

impl Adaptor<LossInput> for LossOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}
