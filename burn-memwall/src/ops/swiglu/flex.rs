//! The Flex path: one rayon pass over the elements each way, in f32 one element at a time (a
//! half-precision input needs no f32 copy).

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{ElementConversion, TensorData};
use rayon::prelude::*;

use super::SwigluBackend;
use crate::ops::flex::{UPDATE_CHUNK, cast_back, contiguous, with_host_float};

fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

impl SwigluBackend for Flex {
    fn swiglu_forward(gate: FloatTensor<Flex>, up: FloatTensor<Flex>) -> FloatTensor<Flex> {
        let (shape, dtype) = (gate.shape(), gate.dtype());
        let (gate, up) = (contiguous(gate), contiguous(cast_back(up, dtype)));
        with_host_float!(dtype, E => {
            let (gate, up) = (gate.storage::<E>(), up.storage::<E>());
            let mut out = vec![E::from_elem(0.0); gate.len()];
            out.par_chunks_mut(UPDATE_CHUNK)
                .zip(gate.par_chunks(UPDATE_CHUNK).zip(up.par_chunks(UPDATE_CHUNK)))
                .for_each(|(out, (gate, up))| {
                    for ((out, a), b) in out.iter_mut().zip(gate).zip(up) {
                        let a = a.elem::<f32>();
                        *out = E::from_elem(a * sigmoid(a) * b.elem::<f32>());
                    }
                });
            Flex::float_from_data(TensorData::new(out, shape), &Default::default())
        })
    }

    fn swiglu_backward(
        gate: FloatTensor<Flex>,
        up: FloatTensor<Flex>,
        dy: FloatTensor<Flex>,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
        let (shape, dtype) = (gate.shape(), gate.dtype());
        let gate = contiguous(gate);
        let (up, dy) = (
            contiguous(cast_back(up, dtype)),
            contiguous(cast_back(dy, dtype)),
        );
        with_host_float!(dtype, E => {
            let (gate, up, dy) = (gate.storage::<E>(), up.storage::<E>(), dy.storage::<E>());
            let zero = E::from_elem(0.0);
            let (mut d_gate, mut d_up) = (vec![zero; gate.len()], vec![zero; gate.len()]);
            let inputs = gate
                .par_chunks(UPDATE_CHUNK)
                .zip(up.par_chunks(UPDATE_CHUNK))
                .zip(dy.par_chunks(UPDATE_CHUNK));
            d_gate
                .par_chunks_mut(UPDATE_CHUNK)
                .zip(d_up.par_chunks_mut(UPDATE_CHUNK))
                .zip(inputs)
                .for_each(|((d_gate, d_up), ((gate, up), dy))| {
                    for (i, ((a, b), g)) in gate.iter().zip(up).zip(dy).enumerate() {
                        let (a, b, g) = (a.elem::<f32>(), b.elem::<f32>(), g.elem::<f32>());
                        let s = sigmoid(a);
                        d_up[i] = E::from_elem(g * a * s);
                        d_gate[i] = E::from_elem(g * b * s * (1.0 + a * (1.0 - s)));
                    }
                });
            let device = Default::default();
            (
                Flex::float_from_data(TensorData::new(d_gate, shape.clone()), &device),
                Flex::float_from_data(TensorData::new(d_up, shape), &device),
            )
        })
    }
}
