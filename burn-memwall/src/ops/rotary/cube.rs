//! The Cube path: `burn-memwall-kernels/src/rotary.rs`, one unit per pair of values.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::cubecl::{CubeDim, calculate_cube_count_elemwise};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_memwall_kernels::rotary::rotary_kernel;

use super::RotaryBackend;
use crate::ops::cube::empty_like;

impl RotaryBackend for CubeBackend {
    fn rotary(x: FloatTensor<Self>, table: FloatTensor<Self>, inverse: bool) -> FloatTensor<Self> {
        let (x, table) = (into_contiguous(x), into_contiguous(table));
        let out = empty_like(&x);
        let pairs = out.meta.num_elements() / 2;
        if pairs == 0 {
            return out; // no cube to launch
        }
        let cube_dim = CubeDim::new(&out.client, pairs);
        let cube_count = calculate_cube_count_elemwise(&out.client, pairs, cube_dim);
        let dtype = out.dtype;
        rotary_kernel::launch(
            &out.client.clone(),
            cube_count,
            cube_dim,
            x.into_tensor_arg(),
            table.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            inverse,
            dtype_to_storage_type(dtype),
        );
        out
    }
}

/// The output is shaped and typed as `x`.
pub(super) fn rotary_spec(x: &TensorSpec, _table: &TensorSpec, _inverse: &bool) -> TensorSpec {
    x.clone()
}
