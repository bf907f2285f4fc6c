//! The Flex path: one rayon pass over the tensors, writing the parameter (and the moment) in
//! place when they are unique (a copy first when they are shared or strided).

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use rayon::prelude::*;

use super::{MomentumStep, MomentumUpdateBackend};
use crate::ops::flex::{UPDATE_CHUNK, cast_back, contiguous_f32};

impl MomentumUpdateBackend for Flex {
    fn momentum_update(
        param: FloatTensor<Flex>,
        grad: FloatTensor<Flex>,
        moment: FloatTensor<Flex>,
        step: MomentumStep,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
        let dtype = param.dtype();
        let mut param = contiguous_f32(param);
        let mut moment = contiguous_f32(moment);
        let grad = contiguous_f32(grad);
        param
            .storage_mut::<f32>()
            .par_chunks_mut(UPDATE_CHUNK)
            .zip(moment.storage_mut::<f32>().par_chunks_mut(UPDATE_CHUNK))
            .zip(grad.storage::<f32>().par_chunks(UPDATE_CHUNK))
            .for_each(|((w, m), g)| {
                for ((w, m), &g) in w.iter_mut().zip(m).zip(g) {
                    (*w, *m) = step.apply(*w, g, *m);
                }
            });
        (cast_back(param, dtype), cast_back(moment, dtype))
    }

    fn sgd_update(
        param: FloatTensor<Flex>,
        grad: FloatTensor<Flex>,
        l2: f32,
        learning_rate: f32,
    ) -> FloatTensor<Flex> {
        let dtype = param.dtype();
        let mut param = contiguous_f32(param);
        let grad = contiguous_f32(grad);
        param
            .storage_mut::<f32>()
            .par_chunks_mut(UPDATE_CHUNK)
            .zip(grad.storage::<f32>().par_chunks(UPDATE_CHUNK))
            .for_each(|(w, g)| {
                for (w, &g) in w.iter_mut().zip(g) {
                    *w -= learning_rate * (g + l2 * *w);
                }
            });
        cast_back(param, dtype)
    }
}
