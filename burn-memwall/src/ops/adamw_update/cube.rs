//! The Cube path: `burn-memwall-kernels/src/adamw.rs`, one unit per element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_memwall_kernels::adamw::adamw_update_kernel;

use super::{AdamWStep, AdamWUpdateBackend};
use crate::ops::cube::{per_element, writable};

impl AdamWUpdateBackend for CubeBackend {
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (param, moment_1, moment_2) = (writable(param), writable(moment_1), writable(moment_2));
        let grad = into_contiguous(grad);
        let (cube_count, cube_dim) = per_element(&param);
        adamw_update_kernel::launch(
            &param.client,
            cube_count,
            cube_dim,
            param.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            moment_1.clone().into_tensor_arg(),
            moment_2.clone().into_tensor_arg(),
            step.beta_1,
            step.beta_2,
            step.bias_correction_1,
            step.bias_correction_2,
            step.epsilon,
            step.decay,
            step.learning_rate,
            dtype_to_storage_type(param.dtype),
        );
        (param, moment_1, moment_2)
    }
}

/// The outputs have the inputs' metadata, for the lazy Fusion backend.
pub(super) fn adamw_update_spec(
    param: &TensorSpec,
    _grad: &TensorSpec,
    moment_1: &TensorSpec,
    moment_2: &TensorSpec,
    _step: &AdamWStep,
) -> (TensorSpec, TensorSpec, TensorSpec) {
    (param.clone(), moment_1.clone(), moment_2.clone())
}
