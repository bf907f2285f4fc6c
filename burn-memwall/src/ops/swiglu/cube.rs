//! The Cube path: `burn-memwall-kernels/src/swiglu.rs`, one unit per element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_memwall_kernels::swiglu::{swiglu_backward_kernel, swiglu_forward_kernel};

use super::SwigluBackend;
use crate::ops::cube::{empty_like, per_element};

impl SwigluBackend for CubeBackend {
    fn swiglu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gate, up) = (into_contiguous(gate), into_contiguous(up));
        let out = empty_like(&gate);
        if out.meta.num_elements() == 0 {
            return out; // no cube to launch
        }
        let (cube_count, cube_dim) = per_element(&out);
        let dtype = out.dtype;
        swiglu_forward_kernel::launch(
            &out.client.clone(),
            cube_count,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dtype_to_storage_type(dtype),
        );
        out
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (gate, up, dy) = (
            into_contiguous(gate),
            into_contiguous(up),
            into_contiguous(dy),
        );
        let (d_gate, d_up) = (empty_like(&gate), empty_like(&gate));
        if d_gate.meta.num_elements() == 0 {
            return (d_gate, d_up); // no cube to launch
        }
        let (cube_count, cube_dim) = per_element(&d_gate);
        let dtype = d_gate.dtype;
        swiglu_backward_kernel::launch(
            &d_gate.client.clone(),
            cube_count,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            dy.into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
            dtype_to_storage_type(dtype),
        );
        (d_gate, d_up)
    }
}

/// The product is shaped and typed as the gate.
pub(super) fn forward_spec(gate: &TensorSpec, _up: &TensorSpec) -> TensorSpec {
    gate.clone()
}

/// Each gradient is shaped and typed as the gate.
pub(super) fn backward_spec(
    gate: &TensorSpec,
    _up: &TensorSpec,
    _dy: &TensorSpec,
) -> (TensorSpec, TensorSpec) {
    (gate.clone(), gate.clone())
}
