//! The Flex path: rayon over the blocks, each block in two passes (decode and update, then the
//! parameter and the codes under the new scales), with `burn_memwall_codes::moments`' host
//! coders in the kernel's arithmetic order, so that both give the same codes.

use burn::backend::Flex;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn_memwall_codes::moments::{Coder, MAX_BLOCK_SIZE, Moment, block_scale, block_size, coder};
use burn_memwall_codes::packing::{field_at, lanes};
use rayon::prelude::*;

use super::LowBitAdamWBackend;
use crate::ops::adamw_update::AdamWStep;
use crate::ops::flex::{cast_back, contiguous_f32, contiguous_u32};

impl LowBitAdamWBackend for Flex {
    fn low_bit_adamw_update(
        param: FloatTensor<Flex>,
        grad: FloatTensor<Flex>,
        words_1: IntTensor<Flex>,
        scales_1: FloatTensor<Flex>,
        words_2: IntTensor<Flex>,
        scales_2: FloatTensor<Flex>,
        // The host's own coders hold the tables, with the index that finds a code quickly.
        _table_1: FloatTensor<Flex>,
        _table_2: FloatTensor<Flex>,
        bits: u32,
        step: AdamWStep,
    ) -> (
        FloatTensor<Flex>,
        IntTensor<Flex>,
        FloatTensor<Flex>,
        IntTensor<Flex>,
        FloatTensor<Flex>,
    ) {
        let dtype = param.dtype();
        let (mut param, grad) = (contiguous_f32(param), contiguous_f32(grad));
        let (mut words_1, mut words_2) = (contiguous_u32(words_1), contiguous_u32(words_2));
        let (mut scales_1, mut scales_2) = (contiguous_f32(scales_1), contiguous_f32(scales_2));
        let coders = [coder(Moment::First, bits), coder(Moment::Second, bits)];
        let block = block_size(bits);
        let words_per_block = block / lanes(bits) as usize;
        param
            .storage_mut::<f32>()
            .par_chunks_mut(block)
            .zip(grad.storage::<f32>().par_chunks(block))
            .zip(words_1.storage_mut::<u32>().par_chunks_mut(words_per_block))
            .zip(words_2.storage_mut::<u32>().par_chunks_mut(words_per_block))
            .zip(scales_1.storage_mut::<f32>().par_iter_mut())
            .zip(scales_2.storage_mut::<f32>().par_iter_mut())
            .for_each(|(((((w, g), words_1), words_2), scale_1), scale_2)| {
                let block = Block {
                    words: [words_1, words_2],
                    scales: [scale_1, scale_2],
                    coders,
                    bits,
                };
                block.update(w, g, &step);
            });
        (
            cast_back(param, dtype),
            words_1,
            scales_1,
            words_2,
            scales_2,
        )
    }
}

/// One block of both moments, as coded.
struct Block<'a> {
    words: [&'a mut [u32]; 2],
    scales: [&'a mut f32; 2],
    coders: [&'a Coder; 2],
    bits: u32,
}

impl Block<'_> {
    /// The block's moments and parameter values `w` after a step with gradients `g`.
    fn update(self, w: &mut [f32], g: &[f32], step: &AdamWStep) {
        let Self {
            words,
            scales,
            coders,
            bits,
        } = self;
        let lanes = lanes(bits) as usize;
        let [table_1, table_2] = coders.map(Coder::table);
        // The moments in f32, as the kernel holds them in its units' registers.
        debug_assert!(w.len() <= MAX_BLOCK_SIZE, "a block of {} values", w.len());
        let mut moments = [[0f32; MAX_BLOCK_SIZE]; 2];
        let mut largest = [0f32; 2];
        // A word at a time: no division per value.
        for (k, g) in g.chunks(lanes).enumerate() {
            let (word_1, word_2) = (words[0][k], words[1][k]);
            for (lane, &g) in g.iter().enumerate() {
                let i = k * lanes + lane;
                let old_1 = table_1[field_at(word_1, lane as u32, bits) as usize] * *scales[0];
                let old_2 = table_2[field_at(word_2, lane as u32, bits) as usize] * *scales[1];
                let (m, v) = step.moments(old_1, old_2, g);
                (moments[0][i], moments[1][i]) = (m, v);
                largest = [largest[0].max(m.abs()), largest[1].max(v)];
            }
        }
        for (w, (&m, &v)) in w.iter_mut().zip(moments[0].iter().zip(&moments[1])) {
            *w = step.weight(*w, m, v);
        }
        for moment in 0..2 {
            let scale = block_scale(largest[moment]);
            // Lanes past the parameter's end code a zero, as the kernel's idle units do.
            for (word, values) in words[moment].iter_mut().zip(moments[moment].chunks(lanes)) {
                *word = values.iter().enumerate().fold(0, |word, (lane, &x)| {
                    word | coders[moment].encode(x / scale) << (lane as u32 * bits)
                });
            }
            *scales[moment] = scale;
        }
    }
}
