//! The update of a parameter with one moment (SGD with momentum, Lion) or none (plain SGD) as
//! one op: a single pass that writes the parameter and the moment in place when nothing else
//! holds them, instead of the tensor ops (and their parameter-sized temporaries) of
//! `burn::optim::Sgd` and `burn::optim::Lion`, whose result lands in another buffer (on Cube,
//! outside the parameter's persistent slot, which then stays reserved and empty). Called by
//! [`crate::optim::FusedSgd`] and [`crate::optim::FusedLion`] on non-autodiff tensors.

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::optim::momentum::MomentumConfig;
use burn::prelude::*;

/// The scalars of one update, one linear form that both optimizers are instances of. With the
/// decayed gradient `g' = g + l2·w`:
///
/// - moment: `m' = keep·m + take·g'`;
/// - direction: `u = from_old·m + from_grad·g' + from_new·m'`, or its sign when `sign`;
/// - parameter: `w' = decay·w − learning_rate·u`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MomentumStep {
    pub l2: f32,
    pub keep: f32,
    pub take: f32,
    pub from_old: f32,
    pub from_grad: f32,
    pub from_new: f32,
    pub sign: bool,
    pub decay: f32,
    pub learning_rate: f32,
}

impl MomentumStep {
    /// `burn::optim::Sgd` with momentum and L2 penalty `l2` (`WeightDecayConfig::penalty`). The
    /// first step (`first`) takes the velocity as the decayed gradient itself, undamped, as
    /// Burn's `Momentum` does.
    pub fn sgd(learning_rate: f64, l2: f32, momentum: &MomentumConfig, first: bool) -> Self {
        let mu = momentum.momentum as f32;
        let (keep, take) = if first {
            (0.0, 1.0)
        } else {
            (mu, (1.0 - momentum.dampening) as f32)
        };
        let (from_grad, from_new) = if momentum.nesterov {
            (1.0, mu)
        } else {
            (0.0, 1.0)
        };
        Self {
            l2,
            keep,
            take,
            from_old: 0.0,
            from_grad,
            from_new,
            sign: false,
            decay: 1.0,
            learning_rate: learning_rate as f32,
        }
    }

    /// `burn::optim::Lion`: the sign of `β₁m + (1−β₁)g`, then `m' = β₂m + (1−β₂)g`, with
    /// decoupled weight decay. A first step is the same formula from `m = 0`.
    pub fn lion(learning_rate: f64, beta_1: f32, beta_2: f32, weight_decay: f32) -> Self {
        Self {
            l2: 0.0,
            keep: beta_2,
            take: 1.0 - beta_2,
            from_old: beta_1,
            from_grad: 1.0 - beta_1,
            from_new: 0.0,
            sign: true,
            decay: (1.0 - learning_rate * weight_decay as f64) as f32,
            learning_rate: learning_rate as f32,
        }
    }

    /// `(w', m')` from one element's `(w, g, m)`, in the kernel's order of operations.
    fn apply(&self, w: f32, g: f32, m: f32) -> (f32, f32) {
        let g = g + self.l2 * w;
        let m_new = self.keep * m + self.take * g;
        let u = self.from_old * m + self.from_grad * g + self.from_new * m_new;
        let u = if self.sign {
            if u > 0.0 {
                1.0
            } else if u < 0.0 {
                -1.0
            } else {
                0.0
            }
        } else {
            u
        };
        (self.decay * w - self.learning_rate * u, m_new)
    }
}

#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub trait MomentumUpdateBackend: Backend {
    /// `(param, moment)` after one step with gradient `grad`; all three have one shape and
    /// dtype. Each output reuses its input's memory when it is not shared.
    #[fusion(meta = cube::momentum_update_spec)]
    fn momentum_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment: FloatTensor<Self>,
        step: MomentumStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `param` after one step of plain SGD with gradient `grad` of its shape and dtype:
    /// `w' = w − learning_rate·(g + l2·w)`. The output reuses the parameter's memory when it is
    /// not shared.
    #[fusion(meta = cube::sgd_update_spec)]
    fn sgd_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        l2: f32,
        learning_rate: f32,
    ) -> FloatTensor<Self>;
}

/// One step of `param` `[...]` with `grad` and `moment` of its shape (not tracked by
/// autodiff). Returns the new `(param, moment)`.
pub fn momentum_update<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moment: Tensor<D>,
    step: MomentumStep,
) -> (Tensor<D>, Tensor<D>) {
    let shape = param.shape();
    for (name, t) in [("grad", &grad), ("moment", &moment)] {
        assert_eq!(
            t.shape(),
            shape,
            "momentum_update: {name} must have the parameter's shape"
        );
    }
    let (param, moment) = Dispatch::momentum_update(
        param.into_dispatch(),
        grad.into_dispatch(),
        moment.into_dispatch(),
        step,
    );
    (Tensor::from_dispatch(param), Tensor::from_dispatch(moment))
}

/// One step of plain SGD on `param` `[...]` with `grad` of its shape (not tracked by autodiff)
/// and L2 penalty `l2`. Returns the new parameter.
pub fn sgd_update<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    l2: f32,
    learning_rate: f64,
) -> Tensor<D> {
    assert_eq!(
        grad.shape(),
        param.shape(),
        "sgd_update: grad must have the parameter's shape"
    );
    Tensor::from_dispatch(Dispatch::sgd_update(
        param.into_dispatch(),
        grad.into_dispatch(),
        l2,
        learning_rate as f32,
    ))
}
