//! The Cube path: `burn-memwall-kernels/src/rounding.rs`, one unit per element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{TensorMetadata, fusion::custom::TensorSpec};
use burn::tensor::{DType, FloatDType};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_memwall_kernels::rounding::stochastic_rounding_kernel;

use super::{StochasticRoundingBackend, half_format};
use crate::ops::cube::per_element;

impl StochasticRoundingBackend for CubeBackend {
    fn round_stochastically(
        values: FloatTensor<Self>,
        dtype: FloatDType,
        key: u32,
    ) -> FloatTensor<Self> {
        let format = half_format(dtype.into()).expect("a half-precision dtype");
        let values = match values.dtype {
            DType::F32 => into_contiguous(values),
            _ => into_contiguous(CubeBackend::float_cast(values, FloatDType::F32)),
        };
        let dtype = DType::from(dtype);
        let out = empty_device_contiguous_dtype(
            values.client.clone(),
            values.device.clone(),
            values.shape(),
            dtype,
        );
        let (cube_count, cube_dim) = per_element(&out);
        stochastic_rounding_kernel::launch(
            &out.client,
            cube_count,
            cube_dim,
            values.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            key,
            format.mantissa_bits(),
            format.exponent_floor(),
            dtype_to_storage_type(dtype),
        );
        out
    }
}

/// The output has the input's shape and the rounded dtype, for the lazy Fusion backend.
pub(super) fn stochastic_rounding_spec(
    values: &TensorSpec,
    dtype: &FloatDType,
    _key: &u32,
) -> TensorSpec {
    TensorSpec::new(values.shape.clone(), DType::from(*dtype))
}
