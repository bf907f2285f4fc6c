//! Token windows for next-token prediction and the batcher that turns them into tensors.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::prelude::*;

use crate::Error;

/// Non-overlapping windows of `seq_len + 1` tokens over one token stream: each window gives
/// `seq_len` inputs and the same tokens shifted by one as targets.
#[derive(Clone, Debug)]
pub struct TokenWindows {
    tokens: Arc<[u32]>,
    seq_len: usize,
}

impl TokenWindows {
    /// Checks every id against `vocab_size` and that at least one window fits.
    pub fn new(tokens: Arc<[u32]>, seq_len: usize, vocab_size: usize) -> Result<Self, Error> {
        if seq_len == 0 {
            return Err(Error::Data("sequence length must be positive".into()));
        }
        if let Some((position, &id)) = tokens
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab_size)
        {
            return Err(Error::TokenOutOfRange {
                id,
                position,
                vocab_size,
            });
        }
        if tokens.len() < seq_len + 1 {
            return Err(Error::Data(format!(
                "{} tokens do not fill one window of {} (sequence length + 1)",
                tokens.len(),
                seq_len + 1
            )));
        }
        Ok(Self { tokens, seq_len })
    }

    /// Tokens per window fed to the model.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
}

impl Dataset<Vec<u32>> for TokenWindows {
    fn get(&self, index: usize) -> Result<Vec<u32>, DatasetError> {
        let start = index * self.seq_len;
        self.tokens
            .get(start..start + self.seq_len + 1)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| {
                DatasetError::new(Error::Data(format!(
                    "window {index} is past the last of {}",
                    self.len()
                )))
            })
    }

    fn len(&self) -> usize {
        (self.tokens.len() - 1) / self.seq_len
    }
}

/// Model inputs and next-token targets, both `[batch, seq]`.
#[derive(Clone, Debug)]
pub struct LmBatch {
    pub inputs: Tensor<2, Int>,
    pub targets: Tensor<2, Int>,
}

/// Stacks windows of `seq_len + 1` ids into an [`LmBatch`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LmBatcher;

impl LmBatcher {
    /// The batch of equal-length `windows`, each `seq_len + 1` ids long.
    pub fn batch_windows(windows: &[Vec<u32>], device: &Device) -> LmBatch {
        let batch = windows.len();
        let window = windows.first().map_or(0, Vec::len);
        assert!(
            window >= 2,
            "a window needs at least two tokens (one input, one target)"
        );
        let seq = window - 1;
        let mut inputs = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        for w in windows {
            assert_eq!(
                w.len(),
                window,
                "all windows of a batch must have the same length"
            );
            inputs.extend(w[..seq].iter().map(|&t| t as i64));
            targets.extend(w[1..].iter().map(|&t| t as i64));
        }
        let tensor =
            |ids: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, seq]), device);
        LmBatch {
            inputs: tensor(inputs),
            targets: tensor(targets),
        }
    }
}

impl Batcher<Vec<u32>, LmBatch> for LmBatcher {
    fn batch(&self, items: Vec<Vec<u32>>, device: &Device) -> LmBatch {
        Self::batch_windows(&items, device)
    }
}
