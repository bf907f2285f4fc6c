//! f32 values rounded stochastically to bf16 or f16 (`burn_memwall_codes::rounding`), each
//! element's uniform number drawn from the counter-based hash of `(key, element)`: the same
//! key gives the same rounding on every backend. [`crate::optim::StochasticRounding`] rounds
//! half-precision weights with it after each update, so that they take updates far below their
//! spacing without an f32 copy; it also casts f32 weights down without the bias of rounding
//! to the nearest.

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_memwall_codes::rounding::HalfFormat;

/// The format a half-precision dtype rounds to; `None` for one that is not half precision.
pub(crate) fn half_format(dtype: DType) -> Option<HalfFormat> {
    match dtype {
        DType::BF16 => Some(HalfFormat::Bf16),
        DType::F16 => Some(HalfFormat::F16),
        _ => None,
    }
}

/// The backends' stochastic rounding ([`round_stochastically`] calls it).
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub trait StochasticRoundingBackend: Backend {
    /// `values` rounded stochastically to `dtype` (bf16 or f16) under `key`.
    #[fusion(meta = cube::stochastic_rounding_spec)]
    fn round_stochastically(
        values: FloatTensor<Self>,
        dtype: FloatDType,
        key: u32,
    ) -> FloatTensor<Self>;
}

/// `values` rounded to `dtype`, up or down at random with the probabilities that make the
/// result `values` in expectation. The uniform number of element `i` (in row-major order) is
/// `burn_memwall_codes::hash::keyed_uniform(key, i)`: a new `key` per update
/// (`hash::draw_key(seed, step)`) gives independent roundings that a resumed run repeats.
///
/// Not differentiable: for tensors outside autodiff (an optimizer's, or `tensor.inner()`).
///
/// # Panics
/// If `dtype` is not bf16 or f16.
pub fn round_stochastically<const D: usize>(
    values: Tensor<D>,
    dtype: FloatDType,
    key: u32,
) -> Tensor<D> {
    assert!(
        half_format(dtype.into()).is_some(),
        "round_stochastically: rounds to bf16 or f16, not {dtype:?}"
    );
    Tensor::from_dispatch(Dispatch::round_stochastically(
        values.into_dispatch(),
        dtype,
        key,
    ))
}
