//! Flex primitives as Burn tensors and back, so that an op's Flex path can be written with the
//! tensor API, and their elements as f32. Like the kernels, which widen every element they
//! load, the Flex paths compute f16 and bf16 inputs in f32.

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
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

/// Elements per rayon task of the in-place update paths: large enough that scheduling is noise
/// next to the arithmetic.
pub(crate) const UPDATE_CHUNK: usize = 1 << 14;

/// A contiguous f32 primitive holding `t`'s values (`t` itself when it already is one), for the
/// in-place update paths that write through `storage_mut` and the paths that read `storage`.
pub(crate) fn contiguous_f32(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    contiguous(match t.dtype() {
        DType::F32 => t,
        _ => Flex::float_cast(t, FloatDType::F32),
    })
}

/// A contiguous primitive holding `t`'s values in its own float type, for the paths that read
/// `storage` one element at a time ([`with_host_float`]).
pub(crate) fn contiguous(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    if covers_its_buffer(&t) {
        t
    } else {
        t.to_contiguous()
    }
}

/// `$body` with the type `$E` named as the element type of the float type `$dtype`: the
/// element-wise paths read `storage::<$E>()` and widen one element at a time to f32
/// (`elem::<f32>()`), so that a half-precision input needs no f32 copy.
macro_rules! with_host_float {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            burn::tensor::DType::F32 => {
                type $E = f32;
                $body
            }
            burn::tensor::DType::F64 => {
                type $E = f64;
                $body
            }
            burn::tensor::DType::BF16 => {
                type $E = half::bf16;
                $body
            }
            burn::tensor::DType::F16 => {
                type $E = half::f16;
                $body
            }
            other => unreachable!("a float tensor of {other:?}"),
        }
    };
}
pub(crate) use with_host_float;

/// Whether `t`'s elements are its whole buffer, in order: what the paths that read or write
/// `storage()` (always the whole buffer, from its start) need. A narrowed view can be
/// contiguous and still start inside its buffer, or end before its end.
fn covers_its_buffer(t: &FloatTensor<Flex>) -> bool {
    let layout = t.layout();
    t.is_contiguous()
        && layout.start_offset() == 0
        && t.bytes().len() == layout.num_elements() * t.dtype().size()
}

/// A contiguous `u32` primitive holding `t`'s values: the packed words of a weight code.
pub(crate) fn contiguous_u32(t: IntTensor<Flex>) -> IntTensor<Flex> {
    assert_eq!(t.dtype(), DType::U32, "packed weights are u32 words");
    if covers_its_buffer(&t) {
        t
    } else {
        t.to_contiguous()
    }
}

/// `t` (f32) cast back to the `dtype` an op's input had.
pub(crate) fn cast_back(t: FloatTensor<Flex>, dtype: DType) -> FloatTensor<Flex> {
    match t.dtype() == dtype {
        true => t,
        false => Flex::float_cast(t, dtype.into()),
    }
}
