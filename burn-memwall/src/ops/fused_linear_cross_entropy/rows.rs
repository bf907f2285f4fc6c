//! Loss, log-sum-exp and gradient of rows of logits on Burn tensors: the Flex path of the row
//! primitives, written as the formulas of `burn-memwall-kernels/src/cross_entropy.rs`.

use burn::prelude::*;
use burn::tensor::IndexingUpdateOp;

use super::RowLoss;

/// `softcap(z)`.
fn capped(logits: Tensor<2>, row_loss: &RowLoss) -> Tensor<2> {
    match row_loss.softcap {
        Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
        None => logits,
    }
}

/// Loss `[rows]` and log-sum-exp `[rows]` of `logits` `[rows, vocab]` against `targets`.
pub(super) fn forward(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    row_loss: &RowLoss,
) -> (Tensor<1>, Tensor<1>) {
    let [rows, vocab] = logits.dims();
    let y = capped(logits, row_loss);
    let max = y.clone().max_dim(1);
    let lse = (y.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let y_target = y.clone().gather(1, targets.reshape([rows, 1]));
    let smoothing = row_loss.label_smoothing as f64;
    let loss = lse.clone()
        - y_target.mul_scalar(1.0 - smoothing)
        - y.sum_dim(1).mul_scalar(smoothing / vocab as f64)
        + lse.clone().powi_scalar(2).mul_scalar(row_loss.z_loss);
    (loss.reshape([rows]), lse.reshape([rows]))
}

/// `∂loss/∂logits · d_loss[row]` `[rows, vocab]`, from the log-sum-exp of [`forward`].
pub(super) fn backward(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    lse: Tensor<1>,
    d_loss: Tensor<1>,
    row_loss: &RowLoss,
) -> Tensor<2> {
    let [rows, vocab] = logits.dims();
    let y = capped(logits, row_loss);
    let (lse, d_loss) = (lse.reshape([rows, 1]), d_loss.reshape([rows, 1]));
    let smoothing = row_loss.label_smoothing as f64;
    let probability_scale = d_loss.clone()
        * lse
            .clone()
            .mul_scalar(2.0 * row_loss.z_loss as f64)
            .add_scalar(1.0);
    let grad = (y.clone() - lse).exp() * probability_scale
        - d_loss.clone().mul_scalar(smoothing / vocab as f64);
    let grad = grad.scatter(
        1,
        targets.reshape([rows, 1]),
        d_loss.mul_scalar(smoothing - 1.0),
        IndexingUpdateOp::Add,
    );
    match row_loss.softcap {
        Some(cap) => grad * y.div_scalar(cap).powi_scalar(2).neg().add_scalar(1.0),
        None => grad,
    }
}
