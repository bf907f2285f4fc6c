//! The AdamW update of one parameter whose moments are kept in 8 or 4 bits
//! (`burn_memwall_codes::moments`): one pass that decodes both moments, updates them and the
//! parameter, and codes the moments again with new block scales, writing the parameter, the
//! words and the scales in place when nothing else holds them. Called by
//! [`crate::optim::LowBitAdamW`] on non-autodiff tensors.

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;
use burn_memwall_codes::moments::{Moment, table};

use super::adamw_update::AdamWStep;

/// One moment of a parameter in codes: the packed words (`u32`, `[⌈n / lanes⌉]`) and one f32
/// scale per block (`[⌈n / block⌉]`), for a parameter of `n` values.
#[derive(Clone, Debug)]
pub(crate) struct CodedMoment {
    pub(crate) words: Tensor<1, Int>,
    pub(crate) scales: Tensor<1>,
}

#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub(crate) trait LowBitAdamWBackend: Backend {
    /// `(param, words_1, scales_1, words_2, scales_2)` after one AdamW step of `param`
    /// (`[n]`) with `grad` (`[n]`, its dtype), the moments coded at `bits` with the tables
    /// `table_1` and `table_2` (f32, `[2^bits]`). Each output reuses its input's memory when it
    /// is not shared.
    // The extension macro reads the outputs from the tuple itself, so no alias can name it.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    #[fusion(meta = cube::low_bit_adamw_update_spec)]
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
    );
}

/// One AdamW step of `param` with `grad` (its shape; not tracked by autodiff) and its moments
/// coded at `bits`. Returns the new `(param, first, second)`.
pub(crate) fn low_bit_adamw_update<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    first: CodedMoment,
    second: CodedMoment,
    bits: u32,
    step: AdamWStep,
) -> (Tensor<D>, CodedMoment, CodedMoment) {
    let shape = param.shape();
    assert_eq!(
        grad.shape(),
        shape,
        "low_bit_adamw_update: the gradient must have the parameter's shape"
    );
    let device = param.device();
    let table_of = |moment| Tensor::<1>::from_floats(table(moment, bits), &device);
    let (param, words_1, scales_1, words_2, scales_2) = Dispatch::low_bit_adamw_update(
        param.flatten::<1>(0, D - 1).into_dispatch(),
        grad.flatten::<1>(0, D - 1).into_dispatch(),
        first.words.into_dispatch(),
        first.scales.into_dispatch(),
        second.words.into_dispatch(),
        second.scales.into_dispatch(),
        table_of(Moment::First).into_dispatch(),
        table_of(Moment::Second).into_dispatch(),
        bits,
        step,
    );
    let moment = |words, scales| CodedMoment {
        words: Tensor::from_dispatch(words),
        scales: Tensor::from_dispatch(scales),
    };
    (
        Tensor::<1>::from_dispatch(param).reshape(shape),
        moment(words_1, scales_1),
        moment(words_2, scales_2),
    )
}
