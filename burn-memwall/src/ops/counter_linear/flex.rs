//! The Flex path: rayon passes over the code's own storage, row by row, with the reference
//! functions of [`burn_memwall_codes::counter`]. The update writes in place when the tensors are
//! not shared (a copy first otherwise).

use burn::backend::Flex;
use burn::backend::tensor::{FloatTensor, IntTensor};
use rayon::prelude::*;

use super::{CounterLinearBackend, CounterStep, RowBlock};
use crate::ops::flex::{contiguous_f32, contiguous_u32};
use burn_memwall_codes::counter::{CounterCode, update_row, words_per_row};

fn code_of(block: &RowBlock) -> CounterCode {
    CounterCode::new(block.limit).expect("a counter linear's limit is valid")
}

impl CounterLinearBackend for Flex {
    fn counter_update(
        codes: IntTensor<Flex>,
        scale: FloatTensor<Flex>,
        mean_square: FloatTensor<Flex>,
        gradient: FloatTensor<Flex>,
        block: RowBlock,
        step: CounterStep,
    ) -> (IntTensor<Flex>, FloatTensor<Flex>, FloatTensor<Flex>) {
        let code = code_of(&block);
        let mut codes = contiguous_u32(codes);
        let mut scale = contiguous_f32(scale);
        let mut mean_square = contiguous_f32(mean_square);
        let gradient = contiguous_f32(gradient);
        let (d_input, width) = (block.d_input, words_per_row(block.d_input));
        let rows = block.start..block.start + block.len;
        codes.storage_mut::<u32>()[rows.start * width..rows.end * width]
            .par_chunks_mut(width)
            .zip(gradient.storage::<f32>().par_chunks(d_input))
            .zip(scale.storage_mut::<f32>()[rows.clone()].par_iter_mut())
            .zip(mean_square.storage_mut::<f32>()[rows.clone()].par_iter_mut())
            .zip(rows.into_par_iter())
            .for_each(|((((words, gradient), scale), mean_square), row)| {
                update_row(
                    code,
                    &step.hyper,
                    step.step,
                    row,
                    words,
                    gradient,
                    mean_square,
                    scale,
                );
            });
        (codes, scale, mean_square)
    }
}
