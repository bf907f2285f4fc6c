//! The AdamW update of one parameter as one op: a single pass that writes the parameter and
//! both moments in place when nothing else holds them, instead of the dozen tensor ops (and
//! their temporaries, each the size of the parameter) of `burn::optim::AdamW`. Called by
//! [`crate::optim::FusedAdamW`] on non-autodiff tensors.

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;

/// The scalars of one update, computed on the host as `burn::optim::AdamW` computes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub beta_1: f32,
    pub beta_2: f32,
    /// `1 − β₁ᵗ` at this step `t` (1 at the first).
    pub bias_correction_1: f32,
    /// `1 − β₂ᵗ`.
    pub bias_correction_2: f32,
    pub epsilon: f32,
    /// `1 − lr · weight_decay`.
    pub decay: f32,
    pub learning_rate: f32,
}

impl AdamWStep {
    /// The moments `(m, v)` after a gradient `g`, from `(m, v)` before: the host's arithmetic
    /// of the kernels' (`burn-memwall-kernels/src/{adamw,low_bit_adamw}.rs`).
    pub(crate) fn moments(&self, m: f32, v: f32, g: f32) -> (f32, f32) {
        (
            m * self.beta_1 + g * (1.0 - self.beta_1),
            v * self.beta_2 + g * g * (1.0 - self.beta_2),
        )
    }

    /// The parameter value `w` after the step, from the moments after it.
    pub(crate) fn weight(&self, w: f32, m: f32, v: f32) -> f32 {
        let delta =
            (m / self.bias_correction_1) / ((v / self.bias_correction_2).sqrt() + self.epsilon);
        w * self.decay - delta * self.learning_rate
    }

    /// The scalars of step `time` (counted from 1).
    pub fn new(
        learning_rate: f64,
        time: usize,
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        weight_decay: f32,
    ) -> Self {
        let time = i32::try_from(time).unwrap_or(i32::MAX);
        Self {
            beta_1,
            beta_2,
            bias_correction_1: 1.0 - beta_1.powi(time),
            bias_correction_2: 1.0 - beta_2.powi(time),
            epsilon,
            decay: (1.0 - learning_rate * weight_decay as f64) as f32,
            learning_rate: learning_rate as f32,
        }
    }
}

#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub trait AdamWUpdateBackend: Backend {
    /// `(param, moment_1, moment_2)` after one AdamW step with gradient `grad`; all four have
    /// one shape and dtype. Each output reuses its input's memory when it is not shared.
    #[fusion(meta = cube::adamw_update_spec)]
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// One AdamW step of `param` `[...]` with `grad`, `moment_1` and `moment_2` of its shape (not
/// tracked by autodiff). Returns the new `(param, moment_1, moment_2)`.
pub fn adamw_update<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moment_1: Tensor<D>,
    moment_2: Tensor<D>,
    step: AdamWStep,
) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
    let shape = param.shape();
    for (name, t) in [
        ("grad", &grad),
        ("moment_1", &moment_1),
        ("moment_2", &moment_2),
    ] {
        assert_eq!(
            t.shape(),
            shape,
            "adamw_update: {name} must have the parameter's shape"
        );
    }
    let (param, moment_1, moment_2) = Dispatch::adamw_update(
        param.into_dispatch(),
        grad.into_dispatch(),
        moment_1.into_dispatch(),
        moment_2.into_dispatch(),
        step,
    );
    (
        Tensor::from_dispatch(param),
        Tensor::from_dispatch(moment_1),
        Tensor::from_dispatch(moment_2),
    )
}
