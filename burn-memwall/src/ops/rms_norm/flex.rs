//! The Flex path: one rayon pass over the rows each way, in f32 one element at a time (a
//! half-precision input needs no f32 copy).

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{Element, TensorData};
use rayon::prelude::*;

use super::RmsNormBackend;
use crate::ops::flex::{cast_back, contiguous, contiguous_f32, with_host_float};

/// Rows per task of the backward pass, each task summing its rows' share of the scale's
/// gradient: enough rows that the `[d]` partial sums cost nothing beside them.
const ROWS_PER_TASK: usize = 64;

impl RmsNormBackend for Flex {
    fn rms_norm_forward(
        x: FloatTensor<Flex>,
        gamma: FloatTensor<Flex>,
        epsilon: f64,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
        let [rows, d] = x.shape().dims();
        let (x, gamma) = (contiguous(x), contiguous_f32(gamma));
        let gamma = gamma.storage::<f32>();
        let device = Default::default();
        let mut rms = vec![0f32; rows];
        let y = with_host_float!(x.dtype(), E => {
            let y = forward_rows::<E>(x.storage(), gamma, epsilon as f32, &mut rms);
            Flex::float_from_data(TensorData::new(y, [rows, d]), &device)
        });
        let rms = Flex::float_from_data(TensorData::new(rms, [rows, 1]), &device);
        (y, rms)
    }

    fn rms_norm_backward(
        dy: FloatTensor<Flex>,
        y: FloatTensor<Flex>,
        gamma: FloatTensor<Flex>,
        rms: FloatTensor<Flex>,
        scale_gradient: bool,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
        let [rows, d] = y.shape().dims();
        let scale_dtype = gamma.dtype();
        let dy = contiguous(cast_back(dy, y.dtype()));
        let (y, gamma, rms) = (contiguous(y), contiguous_f32(gamma), contiguous_f32(rms));
        let (gamma, rms) = (gamma.storage::<f32>(), rms.storage::<f32>());
        let device = Default::default();
        let mut d_scale = vec![0f32; d];
        let dx = with_host_float!(y.dtype(), E => {
            let rows_of = RowsBackward { dy: dy.storage::<E>(), y: y.storage(), gamma, rms };
            let dx = rows_of.backward(scale_gradient.then_some(&mut d_scale));
            Flex::float_from_data(TensorData::new(dx, [rows, d]), &device)
        });
        let d_scale = Flex::float_from_data(TensorData::new(d_scale, [d]), &device);
        (dx, cast_back(d_scale, scale_dtype))
    }
}

/// `y` of each row of `x`, its `rms` written to `rms`.
fn forward_rows<E: Element>(x: &[E], gamma: &[f32], epsilon: f32, rms: &mut [f32]) -> Vec<E> {
    let d = gamma.len();
    let mut y = vec![E::from_elem(0.0); x.len()];
    y.par_chunks_mut(d.max(1))
        .zip(x.par_chunks(d.max(1)))
        .zip(rms.par_iter_mut())
        .for_each(|((y, x), rms)| {
            *rms = (row_dot(x, x) / d as f32 + epsilon).sqrt();
            for ((y, x), g) in y.iter_mut().zip(x).zip(gamma) {
                *y = E::from_elem(x.elem::<f32>() / *rms * g);
            }
        });
    y
}

/// `Σ_j a[j] · b[j]`, in f32.
fn row_dot<E: Element>(a: &[E], b: &[E]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| a.elem::<f32>() * b.elem::<f32>())
        .sum()
}

/// What the backward reads, row by row.
struct RowsBackward<'a, E> {
    dy: &'a [E],
    y: &'a [E],
    gamma: &'a [f32],
    rms: &'a [f32],
}

impl<E: Element> RowsBackward<'_, E> {
    /// `dx`, with `Σ_rows dy · y / γ` written to `d_scale` when given.
    fn backward(&self, d_scale: Option<&mut Vec<f32>>) -> Vec<E> {
        let d = self.gamma.len();
        let task = (ROWS_PER_TASK * d).max(1);
        let mut dx = vec![E::from_elem(0.0); self.y.len()];
        let sums = d_scale.is_some();
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(task)
            .zip(self.dy.par_chunks(task).zip(self.y.par_chunks(task)))
            .zip(self.rms.par_chunks(ROWS_PER_TASK))
            .map(|((dx, (dy, y)), rms)| {
                let mut partial = vec![0f32; if sums { d } else { 0 }];
                let rows = dx.chunks_mut(d).zip(dy.chunks(d).zip(y.chunks(d)));
                for ((dx, (dy, y)), rms) in rows.zip(rms) {
                    let projection = row_dot(dy, y) / d as f32;
                    for (((dx, dy), y), g) in dx.iter_mut().zip(dy).zip(y).zip(self.gamma) {
                        let (dy, y) = (dy.elem::<f32>(), y.elem::<f32>());
                        *dx = E::from_elem((dy * g - y / g * projection) / rms);
                    }
                    for ((p, dy), y) in partial.iter_mut().zip(dy).zip(y) {
                        *p += dy.elem::<f32>() * y.elem::<f32>();
                    }
                }
                partial
            })
            .collect();
        if let Some(d_scale) = d_scale {
            for partial in &partials {
                for (s, p) in d_scale.iter_mut().zip(partial) {
                    *s += p;
                }
            }
            for (s, g) in d_scale.iter_mut().zip(self.gamma) {
                *s /= g;
            }
        }
        dx
    }
}
