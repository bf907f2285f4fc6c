//! The Flex path of the row primitives: the formulas of
//! `burn-memwall-kernels/src/cross_entropy.rs`, row by row on the host in parallel, in one read
//! of each row for the loss and one in-place pass for the gradient. Burn tensor ops would make
//! several `[chunk, vocab]` temporaries per chunk; these make none.

use burn::backend::Flex;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::prelude::*;
use rayon::prelude::*;

use super::{FusedLinearCrossEntropyBackend, RowLoss};
use crate::ops::flex::{cast_back, contiguous_f32};

fn host_f32(t: FloatTensor<Flex>) -> Vec<f32> {
    t.into_data()
        .try_into_vec_as::<f32>()
        .expect("a float tensor")
}

fn host_targets(targets: IntTensor<Flex>) -> Vec<usize> {
    targets
        .into_data()
        .try_into_vec_as::<i64>()
        .expect("an int tensor")
        .into_iter()
        .map(|t| usize::try_from(t).expect("targets are checked before the op"))
        .collect()
}

fn rows_tensor(values: Vec<f32>) -> FloatTensor<Flex> {
    let len = values.len();
    FloatTensor::<Flex>::from_data(TensorData::new(values, [len]))
}

impl RowLoss {
    fn cap(&self, z: f32) -> f32 {
        match self.softcap {
            Some(cap) => cap * (z / cap).tanh(),
            None => z,
        }
    }

    /// `∂y/∂z` written with the capped `y`.
    fn cap_slope(&self, y: f32) -> f32 {
        match self.softcap {
            Some(cap) => 1.0 - (y / cap) * (y / cap),
            None => 1.0,
        }
    }

    /// Loss and log-sum-exp of one row.
    fn row(&self, logits: &[f32], target: usize) -> (f32, f32) {
        let max = logits
            .iter()
            .map(|&z| self.cap(z))
            .fold(f32::NEG_INFINITY, f32::max);
        let (sum, total) = logits.iter().fold((0.0f32, 0.0f32), |(sum, total), &z| {
            let y = self.cap(z);
            (sum + (y - max).exp(), total + y)
        });
        let lse = max + sum.ln();
        let smoothing = self.label_smoothing;
        let loss = lse
            - (1.0 - smoothing) * self.cap(logits[target])
            - smoothing * total / logits.len() as f32
            + self.z_loss * lse * lse;
        (loss, lse)
    }

    /// Overwrites one row of logits with `∂loss/∂logits · upstream`.
    fn row_gradient(&self, logits: &mut [f32], target: usize, lse: f32, upstream: f32) {
        let probability_scale = upstream * (1.0 + 2.0 * self.z_loss * lse);
        let uniform = upstream * self.label_smoothing / logits.len() as f32;
        for (j, z) in logits.iter_mut().enumerate() {
            let y = self.cap(*z);
            let mut dy = (y - lse).exp() * probability_scale - uniform;
            if j == target {
                dy -= upstream * (1.0 - self.label_smoothing);
            }
            *z = dy * self.cap_slope(y);
        }
    }
}

impl FusedLinearCrossEntropyBackend for Flex {
    /// Loss `[rows]` and log-sum-exp `[rows]` (f32) of `logits` `[rows, vocab]`.
    fn cross_entropy_rows_forward(
        logits: FloatTensor<Flex>,
        targets: IntTensor<Flex>,
        row_loss: RowLoss,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
        let logits = contiguous_f32(logits);
        let vocab = logits.layout().shape()[1];
        let values = logits.as_slice::<f32>().expect("contiguous f32");
        let (loss, lse) = values
            .par_chunks(vocab)
            .zip(host_targets(targets))
            .map(|(row, target)| row_loss.row(row, target))
            .unzip();
        (rows_tensor(loss), rows_tensor(lse))
    }

    /// `∂loss/∂logits · d_loss[row]` `[rows, vocab]` in `logits`' dtype, in place when the logits
    /// are f32 and held by nobody else.
    fn cross_entropy_rows_backward(
        logits: FloatTensor<Flex>,
        targets: IntTensor<Flex>,
        lse: FloatTensor<Flex>,
        d_loss: FloatTensor<Flex>,
        row_loss: RowLoss,
    ) -> FloatTensor<Flex> {
        let dtype = logits.dtype();
        let mut grad = contiguous_f32(logits);
        let vocab = grad.layout().shape()[1];
        let rows = host_targets(targets)
            .into_iter()
            .zip(host_f32(lse))
            .zip(host_f32(d_loss));
        grad.storage_mut::<f32>()
            .par_chunks_mut(vocab)
            .zip(rows.collect::<Vec<_>>())
            .for_each(|(row, ((target, lse), upstream))| {
                row_loss.row_gradient(row, target, lse, upstream)
            });
        cast_back(grad, dtype)
    }
}
