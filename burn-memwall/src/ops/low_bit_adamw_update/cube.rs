//! The Cube path: `burn-memwall-kernels/src/low_bit_adamw.rs`, a cube per block.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::cubecl::{CubeCount, CubeDim};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_memwall_codes::moments::block_size;
use burn_memwall_kernels::low_bit_adamw::low_bit_adamw_kernel;

use super::LowBitAdamWBackend;
use crate::ops::adamw_update::AdamWStep;
use crate::ops::cube::writable;

impl LowBitAdamWBackend for CubeBackend {
    fn low_bit_adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        words_1: IntTensor<Self>,
        scales_1: FloatTensor<Self>,
        words_2: IntTensor<Self>,
        scales_2: FloatTensor<Self>,
        table_1: FloatTensor<Self>,
        table_2: FloatTensor<Self>,
        bits: u32,
        step: AdamWStep,
    ) -> (
        FloatTensor<Self>,
        IntTensor<Self>,
        FloatTensor<Self>,
        IntTensor<Self>,
        FloatTensor<Self>,
    ) {
        let param = writable(param);
        let (words_1, scales_1) = (writable(words_1), writable(scales_1));
        let (words_2, scales_2) = (writable(words_2), writable(scales_2));
        let (grad, table_1, table_2) = (
            into_contiguous(grad),
            into_contiguous(table_1),
            into_contiguous(table_2),
        );
        let blocks = scales_1.meta.num_elements();
        let cubes = u32::try_from(blocks)
            .ok()
            .filter(|&cubes| cubes <= param.client.properties().hardware.max_cube_count.0)
            .unwrap_or_else(|| panic!("low-bit AdamW: {blocks} blocks exceed this device's grid"));
        if cubes > 0 {
            let block = block_size(bits);
            low_bit_adamw_kernel::launch(
                &param.client,
                CubeCount::Static(cubes, 1, 1),
                CubeDim::new_1d(block as u32),
                param.clone().into_tensor_arg(),
                grad.into_tensor_arg(),
                words_1.clone().into_tensor_arg(),
                scales_1.clone().into_tensor_arg(),
                words_2.clone().into_tensor_arg(),
                scales_2.clone().into_tensor_arg(),
                table_1.into_tensor_arg(),
                table_2.into_tensor_arg(),
                step.beta_1,
                step.beta_2,
                step.bias_correction_1,
                step.bias_correction_2,
                step.epsilon,
                step.decay,
                step.learning_rate,
                bits,
                block,
                dtype_to_storage_type(param.dtype),
            );
        }
        (param, words_1, scales_1, words_2, scales_2)
    }
}

/// The outputs have the inputs' metadata, for the lazy Fusion backend.
#[allow(clippy::too_many_arguments)]
pub(super) fn low_bit_adamw_update_spec(
    param: &TensorSpec,
    _grad: &TensorSpec,
    words_1: &TensorSpec,
    scales_1: &TensorSpec,
    words_2: &TensorSpec,
    scales_2: &TensorSpec,
    _table_1: &TensorSpec,
    _table_2: &TensorSpec,
    _bits: &u32,
    _step: &AdamWStep,
) -> (TensorSpec, TensorSpec, TensorSpec, TensorSpec, TensorSpec) {
    (
        param.clone(),
        words_1.clone(),
        scales_1.clone(),
        words_2.clone(),
        scales_2.clone(),
    )
}
