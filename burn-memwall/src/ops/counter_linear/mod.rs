//! The device state and update of [`crate::nn::CounterLinear`]. The update of a block of rows
//! from its weight gradient runs in place; the weight gradient is formed a block of rows at a
//! time (`dyᵀ·x` for those rows) and each block is consumed by the update as soon as it is
//! formed. The products with the weight are [`crate::ops::packed_matmul`]'s.
//!
//! - Flex: rayon passes over the code's own storage ([`burn_memwall_codes::counter`]'s
//!   reference functions);
//! - Cube: `burn-memwall-kernels/src/counter.rs`, which mirrors them operation for operation.

#[cfg(feature = "cube")]
mod cube;
mod flex;
pub(crate) mod host_weights;

use std::ops::Range;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;

use burn_memwall_codes::PackedLayout;
use burn_memwall_codes::counter::{CounterCode, CounterHyper, words_per_row};

use super::packed_matmul::packed_weight::PackedWeight;
use super::packed_matmul::row_blocks;
use host_weights::HostWeights;

/// Rows `start .. start + len` of a `[d_output, d_input]` code of limit `limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBlock {
    /// The first row.
    pub start: usize,
    /// Rows in the block.
    pub len: usize,
    /// Weights per row.
    pub d_input: usize,
    /// The counter limit `C`.
    pub limit: i32,
}

/// The scalars of one update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CounterStep {
    /// The update's hyper-parameters.
    pub hyper: CounterHyper,
    /// Counted from 0; keys the stochastic rounding and the statistic's bias correction.
    pub step: u32,
}

/// The backend extension behind [`CounterTensors::update_rows`]: Flex in `flex.rs`, Cube in
/// `cube.rs`.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub trait CounterLinearBackend: Backend {
    /// `(codes, scale, mean_square)` after one update of the rows of `block` from their weight
    /// gradient `[block.len, d_input]` (f32), each written in place when not shared.
    #[fusion(meta = cube::update_spec)]
    fn counter_update(
        codes: IntTensor<Self>,
        scale: FloatTensor<Self>,
        mean_square: FloatTensor<Self>,
        gradient: FloatTensor<Self>,
        block: RowBlock,
        step: CounterStep,
    ) -> (IntTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// A counter linear's state on its device: the packed code `[d_output, words]` (`u32`), and per
/// row the scale and the mean squared gradient (f32).
#[derive(Clone, Debug)]
pub struct CounterTensors {
    /// The code of every weight.
    pub code: CounterCode,
    /// Weights per row.
    pub d_input: usize,
    /// `[d_output, words_per_row(d_input)]`, `u32`.
    pub codes: Tensor<2, Int>,
    /// `[d_output]`: each row's scale.
    pub scale: Tensor<1>,
    /// `[d_output]`: each row's mean squared gradient.
    pub mean_square: Tensor<1>,
}

impl CounterTensors {
    fn block(&self, rows: Range<usize>) -> RowBlock {
        RowBlock {
            start: rows.start,
            len: rows.len(),
            d_input: self.d_input,
            limit: self.code.limit(),
        }
    }

    /// Rows of the weight.
    pub fn d_output(&self) -> usize {
        self.scale.dims()[0]
    }

    /// The weight `s·t`, for its products (handles to the same tensors).
    pub fn weight(&self) -> PackedWeight {
        PackedWeight {
            layout: PackedLayout::Counter(self.code),
            d_input: self.d_input,
            codes: self.codes.clone(),
            scale: self.scale.clone(),
        }
    }

    /// One update from the weight gradient `dyᵀ · x` (`dy` `[m, d_output]`, `x`
    /// `[m, d_input]`, f32), formed and consumed a block of rows at a time.
    pub fn update(&mut self, hyper: &CounterHyper, step: u32, x: &Tensor<2>, dy: &Tensor<2>) {
        for rows in row_blocks(self.d_input, self.d_output()) {
            let (start, len) = (rows.start, rows.len());
            let gradient = dy
                .clone()
                .narrow(1, start, len)
                .transpose()
                .matmul(x.clone());
            self.update_rows(rows, gradient, hyper, step);
        }
    }

    /// One update of `rows` from their weight gradient `[rows.len(), d_input]` (f32), in place
    /// when nothing else holds the state.
    pub fn update_rows(
        &mut self,
        rows: Range<usize>,
        gradient: Tensor<2>,
        hyper: &CounterHyper,
        step: u32,
    ) {
        let step = CounterStep {
            hyper: *hyper,
            step,
        };
        let block = self.block(rows);
        let device = gradient.device();
        // Taken out so that the update finds the only handle and writes in place.
        let codes = std::mem::replace(&mut self.codes, Tensor::empty([0, 0], &device));
        let scale = std::mem::replace(&mut self.scale, Tensor::empty([0], &device));
        let mean_square = std::mem::replace(&mut self.mean_square, Tensor::empty([0], &device));
        let (codes, scale, mean_square) = Dispatch::counter_update(
            codes.into_dispatch(),
            scale.into_dispatch(),
            mean_square.into_dispatch(),
            gradient.into_dispatch(),
            block,
            step,
        );
        self.codes = Tensor::from_dispatch(codes);
        self.scale = Tensor::from_dispatch(scale);
        self.mean_square = Tensor::from_dispatch(mean_square);
    }

    /// The state read back on the host.
    pub fn host(&self) -> HostWeights {
        let floats = |t: &Tensor<1>| t.clone().into_data().try_into_vec_as::<f32>();
        HostWeights {
            code: self.code,
            d_input: self.d_input,
            words: self
                .codes
                .clone()
                .into_data()
                .try_into_vec::<u32>()
                .expect("u32 codes"),
            scale: floats(&self.scale).expect("f32 scales"),
            mean_square: floats(&self.mean_square).expect("f32 statistics"),
        }
    }

    /// `host` on `device`, outside autodiff (the state is never differentiated).
    pub fn from_host(host: HostWeights, device: &Device) -> Self {
        let device = &device.clone().inner();
        let rows = host.scale.len();
        let vector = |values: Vec<f32>| {
            Tensor::from_data(
                TensorData::new(values, [rows]),
                (device, burn::tensor::DType::F32),
            )
        };
        Self {
            code: host.code,
            d_input: host.d_input,
            codes: Tensor::from_data(
                TensorData::new(host.words, [rows, words_per_row(host.d_input)]),
                (device, burn::tensor::DType::U32),
            ),
            scale: vector(host.scale),
            mean_square: vector(host.mean_square),
        }
    }

    /// The same tensors on `device`, outside autodiff.
    pub fn to_device(self, device: &Device) -> Self {
        Self {
            codes: self.codes.to_device(device),
            scale: self.scale.to_device(device),
            mean_square: self.mean_square.to_device(device),
            ..self
        }
        .without_autodiff()
    }

    /// The same tensors outside autodiff, where a mapper or a device move may have put them.
    pub fn without_autodiff(self) -> Self {
        Self {
            codes: self.codes.inner(),
            scale: self.scale.inner(),
            mean_square: self.mean_square.inner(),
            ..self
        }
    }
}
