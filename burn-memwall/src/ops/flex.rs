//! Flex primitives as Burn tensors and back, so that an op's Flex path can be written with the
//! tensor API. Like the kernels, which widen every element they load, the Flex paths compute
//! f16 and bf16 inputs in f32.

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{BackendTensor, DispatchKindConversion, DispatchTensor, Flex};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

fn dispatch(t: BackendTensor<Flex>) -> DispatchTensor {
    <DispatchTensor as DispatchKindConversion<Flex>>::from_backend(t)
}

/// A Flex float primitive as an f32 Burn tensor.
pub(crate) fn float<const D: usize>(t: FloatTensor<Flex>) -> Tensor<D> {
    Tensor::<D>::from_dispatch(dispatch(BackendTensor::Float(t))).cast(FloatDType::F32)
}

pub(crate) fn bool<const D: usize>(t: BoolTensor<Flex>) -> Tensor<D, Bool> {
    Tensor::from_dispatch(dispatch(BackendTensor::Bool(t)))
}

/// A Burn tensor computed from Flex inputs as a Flex primitive of `dtype`.
pub(crate) fn primitive<const D: usize>(t: Tensor<D>, dtype: DType) -> FloatTensor<Flex> {
    match <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(
        t.cast(dtype).into_dispatch(),
    ) {
        Ok(BackendTensor::Float(t)) => t,
        Ok(_) => unreachable!("a float tensor stays a float tensor"),
        Err(error) => unreachable!("a tensor computed from Flex inputs stays on Flex: {error}"),
    }
}
