//! The Cube path of the row primitives: the CubeCL kernels of
//! `burn-memwall-kernels/src/cross_entropy.rs` behind [`FusedLinearCrossEntropyBackend`].

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::IntTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{TensorMetadata, fusion::custom::TensorSpec};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::cubecl::{CubeDim, prelude::CubeCount};
use burn_cubecl::kernel::untile;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use burn_memwall_kernels::cross_entropy::{
    cross_entropy_rows_backward_kernel, cross_entropy_rows_forward_kernel,
};

use super::{FusedLinearCrossEntropyBackend, RowLoss};
use crate::ops::cube::per_row;

/// Targets reach the kernels as f32, exact up to here.
const MAX_VOCAB: usize = 1 << 24;

/// The grid over the rows of `logits` (`crate::ops::cube::per_row`).
fn grid(logits: &CubeTensor) -> (CubeCount, CubeDim, usize) {
    let [rows, vocab] = logits.shape().dims();
    assert!(
        vocab <= MAX_VOCAB,
        "fused linear cross-entropy: vocabularies above {MAX_VOCAB} are not supported ({vocab})"
    );
    per_row(logits, rows, "fused linear cross-entropy")
}

fn targets_f32(targets: IntTensor<CubeBackend>) -> CubeTensor {
    CubeBackend::int_into_float(targets, FloatDType::F32)
}

fn rows_f32(t: &CubeTensor) -> CubeTensor {
    let rows = t.shape()[0];
    empty_device_contiguous_dtype(
        t.client.clone(),
        t.device.clone(),
        Shape::new([rows]),
        DType::F32,
    )
}

impl FusedLinearCrossEntropyBackend for CubeBackend {
    fn cross_entropy_rows_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        row_loss: RowLoss,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let logits = untile(logits);
        let (cube_count, cube_dim, units) = grid(&logits);
        let (loss, lse) = (rows_f32(&logits), rows_f32(&logits));
        cross_entropy_rows_forward_kernel::launch(
            &logits.client.clone(),
            cube_count,
            cube_dim,
            logits.clone().into_tensor_arg(),
            targets_f32(targets).into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            row_loss.label_smoothing,
            row_loss.z_loss,
            row_loss.softcap.unwrap_or(1.0),
            units,
            row_loss.softcap.is_some(),
            dtype_to_storage_type(logits.dtype),
        );
        (loss, lse)
    }

    fn cross_entropy_rows_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        d_loss: FloatTensor<Self>,
        row_loss: RowLoss,
    ) -> FloatTensor<Self> {
        // The kernel overwrites the logits with their gradient; a copy only when they are shared.
        let logits = untile(logits);
        let grad = if logits.can_mut() && logits.is_nonoverlapping() {
            logits
        } else {
            logits.copy()
        };
        let (cube_count, cube_dim, units) = grid(&grad);
        cross_entropy_rows_backward_kernel::launch(
            &grad.client.clone(),
            cube_count,
            cube_dim,
            grad.clone().into_tensor_arg(),
            targets_f32(targets).into_tensor_arg(),
            untile(lse).into_tensor_arg(),
            untile(d_loss).into_tensor_arg(),
            row_loss.label_smoothing,
            row_loss.z_loss,
            row_loss.softcap.unwrap_or(1.0),
            units,
            row_loss.softcap.is_some(),
            dtype_to_storage_type(grad.dtype),
        );
        grad
    }
}

/// The Cube forward returns a loss and a log-sum-exp per row, both f32.
pub(super) fn rows_forward_spec(
    logits: &TensorSpec,
    _targets: &TensorSpec,
    _row_loss: &RowLoss,
) -> (TensorSpec, TensorSpec) {
    let rows = TensorSpec::new(Shape::new([logits.shape[0]]), DType::F32);
    (rows.clone(), rows)
}

/// The gradient is shaped and typed as the logits.
pub(super) fn rows_backward_spec(
    logits: &TensorSpec,
    _targets: &TensorSpec,
    _lse: &TensorSpec,
    _d_loss: &TensorSpec,
    _row_loss: &RowLoss,
) -> TensorSpec {
    logits.clone()
}
