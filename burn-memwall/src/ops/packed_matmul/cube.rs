//! The Cube path: `burn-memwall-kernels/src/packed_matmul.rs`.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::cubecl::{CubeCount, CubeDim};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_memwall_kernels::packed_matmul::{
    TILE_COLUMNS, UNITS_PER_SIDE, packed_decode_kernel, packed_matmul_kernel,
};

use burn_memwall_codes::PackedLayout;

use super::{PackedMatmulBackend, PackedShape, Product};
use crate::ops::cube::per_element;

impl PackedMatmulBackend for CubeBackend {
    fn packed_matmul(
        input: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scale: FloatTensor<Self>,
        weight: PackedShape,
        product: Product,
    ) -> FloatTensor<Self> {
        let (input, codes, scale) = (
            into_contiguous(input),
            into_contiguous(codes),
            into_contiguous(scale),
        );
        let rows = input.meta.shape()[0];
        let (_, columns, _) = weight.widths(product);
        let output = empty_device_contiguous_dtype(
            input.client.clone(),
            input.device.clone(),
            Shape::new([rows, columns]),
            DType::F32,
        );
        if rows == 0 {
            return output; // no cube to launch
        }
        let (counter, counter_limit) = kernel_layout(weight.layout);
        // 8 rows per unit where the rows fill them; fewer for a small batch.
        let rows_per_unit = rows.div_ceil(UNITS_PER_SIDE).next_power_of_two().min(8);
        packed_matmul_kernel::launch(
            &output.client,
            CubeCount::Static(
                columns.div_ceil(TILE_COLUMNS) as u32,
                rows.div_ceil(UNITS_PER_SIDE * rows_per_unit) as u32,
                1,
            ),
            CubeDim::new_2d(UNITS_PER_SIDE as u32, UNITS_PER_SIDE as u32),
            input.into_tensor_arg(),
            codes.into_tensor_arg(),
            scale.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            weight.d_input as u32,
            weight.d_output as u32,
            weight.layout.words_per_row(weight.d_input) as u32,
            counter_limit,
            rows_per_unit,
            counter,
            product == Product::Transposed,
        );
        output
    }

    fn packed_decode(
        codes: IntTensor<Self>,
        scale: FloatTensor<Self>,
        weight: PackedShape,
    ) -> FloatTensor<Self> {
        let (codes, scale) = (into_contiguous(codes), into_contiguous(scale));
        let output = empty_device_contiguous_dtype(
            codes.client.clone(),
            codes.device.clone(),
            Shape::new([weight.d_output, weight.d_input]),
            DType::F32,
        );
        if weight.d_output * weight.d_input == 0 {
            return output; // no cube to launch
        }
        let (counter, counter_limit) = kernel_layout(weight.layout);
        let (cube_count, cube_dim) = per_element(&output);
        packed_decode_kernel::launch(
            &output.client,
            cube_count,
            cube_dim,
            codes.into_tensor_arg(),
            scale.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            weight.d_input as u32,
            weight.layout.words_per_row(weight.d_input) as u32,
            counter_limit,
            counter,
        );
        output
    }
}

/// The kernels' `counter` switch and counter limit `C` of `layout`.
fn kernel_layout(layout: PackedLayout) -> (bool, u32) {
    match layout {
        PackedLayout::Ternary => (false, 0),
        PackedLayout::Counter(code) => (true, code.limit() as u32),
    }
}

/// The product: `[m, d_output]` or `[m, d_input]` f32, for the lazy Fusion backend.
pub(super) fn product_spec(
    input: &TensorSpec,
    _codes: &TensorSpec,
    _scale: &TensorSpec,
    weight: &PackedShape,
    product: &Product,
) -> TensorSpec {
    TensorSpec::new(
        Shape::new([input.shape[0], weight.widths(*product).1]),
        DType::F32,
    )
}

/// The weight: `[d_output, d_input]` f32, for the lazy Fusion backend.
pub(super) fn decode_spec(
    _codes: &TensorSpec,
    _scale: &TensorSpec,
    weight: &PackedShape,
) -> TensorSpec {
    TensorSpec::new(Shape::new([weight.d_output, weight.d_input]), DType::F32)
}
