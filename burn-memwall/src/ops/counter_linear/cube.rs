//! The Cube path: `burn-memwall-kernels/src/counter.rs`.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::cubecl::{CubeCount, CubeDim};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_memwall_kernels::counter::counter_update_kernel;

use super::{CounterLinearBackend, CounterStep, RowBlock};
use crate::ops::cube::writable;
use burn_memwall_codes::counter::{STATISTIC_LANES, bias_correction, words_per_row};
use burn_memwall_codes::hash::draw_key;

impl CounterLinearBackend for CubeBackend {
    fn counter_update(
        codes: IntTensor<Self>,
        scale: FloatTensor<Self>,
        mean_square: FloatTensor<Self>,
        gradient: FloatTensor<Self>,
        block: RowBlock,
        step: CounterStep,
    ) -> (IntTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (codes, scale, mean_square) = (writable(codes), writable(scale), writable(mean_square));
        let gradient = into_contiguous(gradient);
        let hyper = step.hyper;
        counter_update_kernel::launch(
            &codes.client,
            CubeCount::Static(block.len as u32, 1, 1),
            CubeDim::new_1d(STATISTIC_LANES as u32),
            codes.clone().into_tensor_arg(),
            scale.clone().into_tensor_arg(),
            mean_square.clone().into_tensor_arg(),
            gradient.into_tensor_arg(),
            block.start as u32,
            block.d_input as u32,
            words_per_row(block.d_input) as u32,
            block.limit as u32,
            hyper.learning_rate,
            hyper.scale_learning_rate,
            hyper.beta,
            bias_correction(hyper.beta, step.step),
            hyper.epsilon,
            draw_key(hyper.seed, step.step),
            STATISTIC_LANES,
        );
        (codes, scale, mean_square)
    }
}

/// The outputs have the inputs' metadata.
pub(super) fn update_spec(
    codes: &TensorSpec,
    scale: &TensorSpec,
    mean_square: &TensorSpec,
    _gradient: &TensorSpec,
    _block: &RowBlock,
    _step: &CounterStep,
) -> (TensorSpec, TensorSpec, TensorSpec) {
    (codes.clone(), scale.clone(), mean_square.clone())
}
