//! The Cube path: `burn-memwall-kernels/src/momentum.rs`, one unit per element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_memwall_kernels::momentum::{momentum_update_kernel, sgd_update_kernel};

use super::{MomentumStep, MomentumUpdateBackend};
use crate::ops::cube::{per_element, writable};

impl MomentumUpdateBackend for CubeBackend {
    fn momentum_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment: FloatTensor<Self>,
        step: MomentumStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (param, moment) = (writable(param), writable(moment));
        let grad = into_contiguous(grad);
        let (cube_count, cube_dim) = per_element(&param);
        momentum_update_kernel::launch(
            &param.client,
            cube_count,
            cube_dim,
            param.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            moment.clone().into_tensor_arg(),
            step.l2,
            step.keep,
            step.take,
            step.from_old,
            step.from_grad,
            step.from_new,
            step.decay,
            step.learning_rate,
            step.sign,
            dtype_to_storage_type(param.dtype),
        );
        (param, moment)
    }

    fn sgd_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        l2: f32,
        learning_rate: f32,
    ) -> FloatTensor<Self> {
        let param = writable(param);
        let grad = into_contiguous(grad);
        let (cube_count, cube_dim) = per_element(&param);
        sgd_update_kernel::launch(
            &param.client,
            cube_count,
            cube_dim,
            param.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            l2,
            learning_rate,
            dtype_to_storage_type(param.dtype),
        );
        param
    }
}

/// The outputs have the inputs' metadata, for the lazy Fusion backend.
pub(super) fn momentum_update_spec(
    param: &TensorSpec,
    _grad: &TensorSpec,
    moment: &TensorSpec,
    _step: &MomentumStep,
) -> (TensorSpec, TensorSpec) {
    (param.clone(), moment.clone())
}

/// The output has the parameter's metadata.
pub(super) fn sgd_update_spec(
    param: &TensorSpec,
    _grad: &TensorSpec,
    _l2: &f32,
    _learning_rate: &f32,
) -> TensorSpec {
    param.clone()
}
