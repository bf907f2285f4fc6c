//! The Flex path: one rayon pass over the rows each way.

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{FloatDType, TensorData};
use burn_memwall_codes::hash::keyed_uniform;
use burn_memwall_codes::saved_rows::{code_at, field, lanes, words_per_row};
use rayon::prelude::*;

use super::SavedRowsBackend;
use crate::ops::flex::{cast_back, contiguous_f32, contiguous_u32};

impl SavedRowsBackend for Flex {
    fn pack_rows(
        values: FloatTensor<Flex>,
        scales: FloatTensor<Flex>,
        bits: u32,
        key: u32,
    ) -> IntTensor<Flex> {
        let [rows, width] = values.shape().dims();
        let (values, scales) = (contiguous_f32(values), contiguous_f32(scales));
        let (values, scales) = (values.storage::<f32>(), scales.storage::<f32>());
        let (lanes, per_row) = (lanes(bits) as usize, words_per_row(width, bits));
        let mut words = vec![0u32; rows * per_row];
        words
            .par_chunks_mut(per_row.max(1))
            .enumerate()
            .for_each(|(row, words)| {
                let start = row * width;
                let row_values = &values[start..start + width];
                for (w, (word, group)) in words.iter_mut().zip(row_values.chunks(lanes)).enumerate()
                {
                    for (lane, &x) in group.iter().enumerate() {
                        let i = start + w * lanes + lane;
                        let u = keyed_uniform(key, i as u32);
                        *word |= field(x, scales[row], u, bits) << (bits * lane as u32);
                    }
                }
            });
        Flex::int_from_data(TensorData::new(words, [rows, per_row]), &Default::default())
    }

    fn restore_rows(
        words: IntTensor<Flex>,
        scales: FloatTensor<Flex>,
        bits: u32,
        width: usize,
        dtype: FloatDType,
    ) -> FloatTensor<Flex> {
        let [rows, per_row] = words.shape().dims();
        let (words, scales) = (contiguous_u32(words), contiguous_f32(scales));
        let (words, scales) = (words.storage::<u32>(), scales.storage::<f32>());
        let lanes = lanes(bits) as usize;
        let mut out = vec![0f32; rows * width];
        out.par_chunks_mut(width.max(1))
            .enumerate()
            .for_each(|(row, out)| {
                let words = &words[row * per_row..(row + 1) * per_row];
                for (column, value) in out.iter_mut().enumerate() {
                    let code = code_at(words[column / lanes], (column % lanes) as u32, bits);
                    *value = code as f32 * scales[row];
                }
            });
        let out = Flex::float_from_data(TensorData::new(out, [rows, width]), &Default::default());
        cast_back(out, dtype.into())
    }
}
