//! The Cube path: `burn-memwall-kernels/src/rms_norm.rs`, a cube per row each way, and the
//! scale's gradient summed over row chunks by one unit per chunk and column.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{TensorMetadata, fusion::custom::TensorSpec};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use burn_memwall_kernels::rms_norm::{
    rms_norm_backward_kernel, rms_norm_forward_kernel, rms_norm_scale_gradient_kernel,
};

use super::RmsNormBackend;
use crate::ops::cube::{empty_like, per_element, per_row};

/// Rows each unit of the scale's gradient sums: the partial sums (`[rows / this, d]`, f32)
/// stay small beside the rows, and there are still units enough to fill a device.
const ROWS_PER_UNIT: usize = 64;

impl RmsNormBackend for CubeBackend {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, gamma) = (into_contiguous(x), into_contiguous(gamma));
        let [rows, d] = x.shape().dims();
        let y = empty_like(&x);
        let rms = empty_device_contiguous_dtype(
            x.client.clone(),
            x.device.clone(),
            Shape::new([rows, 1]),
            DType::F32,
        );
        if rows * d == 0 {
            return (y, rms); // no cube to launch
        }
        let (cube_count, cube_dim, units) = per_row(&x, rows, "rms_norm");
        let dtype = x.dtype;
        rms_norm_forward_kernel::launch(
            &x.client.clone(),
            cube_count,
            cube_dim,
            x.into_tensor_arg(),
            gamma.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            rms.clone().into_tensor_arg(),
            epsilon as f32,
            units,
            dtype_to_storage_type(dtype),
        );
        (y, rms)
    }

    fn rms_norm_backward(
        dy: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rms: FloatTensor<Self>,
        scale_gradient: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dy, y) = (into_contiguous(dy), into_contiguous(y));
        let (gamma, rms) = (into_contiguous(gamma), into_contiguous(rms));
        let [rows, d] = y.shape().dims();
        let dtype = y.dtype;
        let dx = empty_like(&y);
        let zeros = || {
            zeros_client(
                gamma.client.clone(),
                gamma.device.clone(),
                gamma.shape(),
                gamma.dtype,
            )
        };
        if rows * d == 0 {
            return (dx, zeros()); // no cube to launch
        }
        let (cube_count, cube_dim, units) = per_row(&y, rows, "rms_norm");
        rms_norm_backward_kernel::launch(
            &y.client.clone(),
            cube_count,
            cube_dim,
            dy.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            gamma.clone().into_tensor_arg(),
            rms.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            units,
            dtype_to_storage_type(dtype),
        );
        let d_scale = match scale_gradient {
            true => scale_gradient_of(dy, y, gamma),
            false => zeros(),
        };
        (dx, d_scale)
    }
}

/// `Σ_rows dy · y / γ`, in `γ`'s float type: the sums over row chunks, then theirs.
fn scale_gradient_of(dy: CubeTensor, y: CubeTensor, gamma: CubeTensor) -> CubeTensor {
    let [rows, d] = y.shape().dims();
    let dtype = y.dtype;
    let partial = empty_device_contiguous_dtype(
        y.client.clone(),
        y.device.clone(),
        Shape::new([rows.div_ceil(ROWS_PER_UNIT), d]),
        DType::F32,
    );
    let (cube_count, cube_dim) = per_element(&partial);
    rms_norm_scale_gradient_kernel::launch(
        &y.client.clone(),
        cube_count,
        cube_dim,
        dy.into_tensor_arg(),
        y.into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        ROWS_PER_UNIT as u32,
        dtype_to_storage_type(dtype),
    );
    let sum = CubeBackend::float_reshape(CubeBackend::float_sum_dim(partial, 0), Shape::new([d]));
    let scale_dtype = gamma.dtype;
    let gamma = CubeBackend::float_cast(gamma, FloatDType::F32);
    CubeBackend::float_cast(CubeBackend::float_div(sum, gamma), scale_dtype.into())
}

/// `y` is shaped and typed as `x`; `rms` is `[rows, 1]`, f32.
pub(super) fn forward_spec(
    x: &TensorSpec,
    _gamma: &TensorSpec,
    _epsilon: &f64,
) -> (TensorSpec, TensorSpec) {
    let rms = TensorSpec::new(Shape::new([x.shape[0], 1]), DType::F32);
    (x.clone(), rms)
}

/// `dx` is shaped and typed as `y`, `dγ` as `γ`.
pub(super) fn backward_spec(
    _dy: &TensorSpec,
    y: &TensorSpec,
    gamma: &TensorSpec,
    _rms: &TensorSpec,
    _scale_gradient: &bool,
) -> (TensorSpec, TensorSpec) {
    (y.clone(), gamma.clone())
}
