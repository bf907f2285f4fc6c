//! The Flex path: one rayon pass over the four tensors, writing the parameter and the moments
//! in place when they are unique (a copy first when they are shared or strided).

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use rayon::prelude::*;

use super::{AdamWStep, AdamWUpdateBackend};
use crate::ops::flex::{UPDATE_CHUNK, cast_back, contiguous_f32};

impl AdamWUpdateBackend for Flex {
    fn adamw_update(
        param: FloatTensor<Flex>,
        grad: FloatTensor<Flex>,
        moment_1: FloatTensor<Flex>,
        moment_2: FloatTensor<Flex>,
        step: AdamWStep,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>, FloatTensor<Flex>) {
        let dtype = param.dtype();
        let mut param = contiguous_f32(param);
        let mut moment_1 = contiguous_f32(moment_1);
        let mut moment_2 = contiguous_f32(moment_2);
        let grad = contiguous_f32(grad);
        param
            .storage_mut::<f32>()
            .par_chunks_mut(UPDATE_CHUNK)
            .zip(moment_1.storage_mut::<f32>().par_chunks_mut(UPDATE_CHUNK))
            .zip(moment_2.storage_mut::<f32>().par_chunks_mut(UPDATE_CHUNK))
            .zip(grad.storage::<f32>().par_chunks(UPDATE_CHUNK))
            .for_each(|(((w, m), v), g)| {
                for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(g) {
                    (*m, *v) = step.moments(*m, *v, g);
                    *w = step.weight(*w, *m, *v);
                }
            });
        (
            cast_back(param, dtype),
            cast_back(moment_1, dtype),
            cast_back(moment_2, dtype),
        )
    }
}
