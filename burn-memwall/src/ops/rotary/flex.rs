//! The Flex path: one rayon pass over the rows, in f32 one element at a time.

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{ElementConversion, TensorData};
use rayon::prelude::*;

use super::RotaryBackend;
use crate::ops::flex::{contiguous, contiguous_f32, with_host_float};

impl RotaryBackend for Flex {
    fn rotary(x: FloatTensor<Flex>, table: FloatTensor<Flex>, inverse: bool) -> FloatTensor<Flex> {
        let shape = x.shape();
        let [rows, width] = shape.dims();
        let [seq, d_head, _] = table.shape().dims();
        let (x, table) = (contiguous(x), contiguous_f32(table));
        let table = table.storage::<f32>();
        // The sine's sign: turning back is turning by the opposite angle.
        let sign = if inverse { -1.0 } else { 1.0 };
        with_host_float!(x.dtype(), E => {
            let x = x.storage::<E>();
            let mut out = vec![E::from_elem(0.0); rows * width];
            out.par_chunks_mut(width.max(1))
                .zip(x.par_chunks(width.max(1)))
                .enumerate()
                .for_each(|(row, (out, x))| {
                    let angles = &table[(row % seq) * d_head * 2..][..d_head * 2];
                    for (column, (out, x)) in
                        out.chunks_exact_mut(2).zip(x.chunks_exact(2)).enumerate()
                    {
                        let j = (2 * column) % d_head;
                        let (cos, sin) = (angles[2 * j], sign * angles[2 * j + 1]);
                        let (a, b) = (x[0].elem::<f32>(), x[1].elem::<f32>());
                        out[0] = E::from_elem(a * cos - b * sin);
                        out[1] = E::from_elem(a * sin + b * cos);
                    }
                });
            Flex::float_from_data(TensorData::new(out, [rows, width]), &Default::default())
        })
    }
}
