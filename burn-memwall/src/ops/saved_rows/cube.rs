//! The Cube path: `burn-memwall-kernels/src/saved_rows.rs`, one unit per word to pack, one per
//! value to restore.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{TensorMetadata, fusion::custom::TensorSpec};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_memwall_codes::saved_rows::words_per_row;
use burn_memwall_kernels::saved_rows::{pack_rows_kernel, restore_rows_kernel};

use super::SavedRowsBackend;
use crate::ops::cube::per_element;

impl SavedRowsBackend for CubeBackend {
    fn pack_rows(
        values: FloatTensor<Self>,
        scales: FloatTensor<Self>,
        bits: u32,
        key: u32,
    ) -> IntTensor<Self> {
        let (values, scales) = (into_contiguous(values), into_contiguous(scales));
        let [rows, width] = values.shape().dims();
        let per_row = words_per_row(width, bits);
        let words = empty_device_contiguous_dtype(
            values.client.clone(),
            values.device.clone(),
            Shape::new([rows, per_row]),
            DType::U32,
        );
        if rows * per_row == 0 {
            return words; // no cube to launch
        }
        let dtype = values.dtype;
        let (cube_count, cube_dim) = per_element(&words);
        pack_rows_kernel::launch(
            &words.client,
            cube_count,
            cube_dim,
            values.into_tensor_arg(),
            scales.into_tensor_arg(),
            words.clone().into_tensor_arg(),
            width as u32,
            per_row as u32,
            key,
            bits,
            dtype_to_storage_type(dtype),
        );
        words
    }

    fn restore_rows(
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
        bits: u32,
        width: usize,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let (words, scales) = (into_contiguous(words), into_contiguous(scales));
        let [rows, per_row] = words.shape().dims();
        let dtype = DType::from(dtype);
        let out = empty_device_contiguous_dtype(
            words.client.clone(),
            words.device.clone(),
            Shape::new([rows, width]),
            dtype,
        );
        if rows * width == 0 {
            return out; // no cube to launch
        }
        let (cube_count, cube_dim) = per_element(&out);
        restore_rows_kernel::launch(
            &out.client,
            cube_count,
            cube_dim,
            words.into_tensor_arg(),
            scales.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            width as u32,
            per_row as u32,
            bits,
            dtype_to_storage_type(dtype),
        );
        out
    }
}

/// The words: `[rows, ⌈width / lanes⌉]` `u32`, for the lazy Fusion backend.
pub(super) fn pack_spec(
    values: &TensorSpec,
    _scales: &TensorSpec,
    bits: &u32,
    _key: &u32,
) -> TensorSpec {
    let [rows, width] = values.shape.dims();
    TensorSpec::new(Shape::new([rows, words_per_row(width, *bits)]), DType::U32)
}

/// The values: `[rows, width]` in `dtype`, for the lazy Fusion backend.
pub(super) fn restore_spec(
    words: &TensorSpec,
    _scales: &TensorSpec,
    _bits: &u32,
    width: &usize,
    dtype: &FloatDType,
) -> TensorSpec {
    TensorSpec::new(Shape::new([words.shape[0], *width]), DType::from(*dtype))
}
