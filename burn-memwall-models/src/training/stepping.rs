//! What steps a run, made once: the optimizer, the block schedule and the loss scale, and the
//! model made ready for them.

use burn::module::{ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall::memory::budget::ParameterCensus;
use burn_memwall::optim::{BlockCoordinate, InBackward, LossScale};

use crate::Error;
use crate::lm::LanguageModel;

use super::RunConfig;

/// The parts of a run that update its model, made together before anything large is: making
/// them is the check that the device can take the run (an offload from Flex is refused here),
/// so that a refused run leaves nothing behind.
pub(super) struct Stepping {
    /// The update during backward, shared by the model's routed ops and the training loop.
    pub in_backward: Option<InBackward>,
    /// The dynamic loss scale of a run in f16, shared by the model and the optimizer.
    pub loss_scale: Option<LossScale>,
    pub optimizer: ModuleOptimizer,
    pub block_coordinate: Option<BlockCoordinate>,
}

impl RunConfig {
    /// The run's [`Stepping`] on `device`.
    ///
    /// # Errors
    /// A device that does not compute in the run's precision (its default float type), and
    /// what the optimizer or the block schedule refuse on it.
    pub(super) fn stepping(&self, device: &Device) -> Result<Stepping, Error> {
        let training = &self.training;
        let (want, have) = (training.precision.dtype(), device.settings().float_dtype);
        if want != have {
            return Err(Error::Training(format!(
                "the run trains in {want:?}, the device computes in {have:?}: start it in the \
                 run's (DeviceChoice::device_in or start_as_default_in)"
            )));
        }
        let loss_scale = training
            .precision
            .scales_loss()
            .then(|| training.loss_scale.init());
        let optimizer = training.optimizer.init(
            training.weight_decay,
            training.precision,
            training.seed,
            loss_scale.as_ref(),
            training.host_offload.map(|offload| (offload, device)),
        )?;
        let block_coordinate = match training.block_coordinate {
            Some(schedule) => Some(schedule.init(&self.model, device)?),
            None => None,
        };
        Ok(Stepping {
            in_backward: training.optimizer.in_backward(),
            loss_scale,
            optimizer,
            block_coordinate,
        })
    }
}

impl Stepping {
    /// `model` ready for its first step, and its parameters counted: routed through the
    /// in-backward update and the loss scale, and every weight drawn now, in the model's order,
    /// rather than at its first read inside the first step (where it would be allocated between
    /// the activations, in an order that depends on the stack). A schedule that keeps the
    /// waiting blocks' weights in host memory draws them itself, one at a time, and moves each
    /// there at once, so that the device never holds them all.
    pub fn prepare(&mut self, model: LanguageModel) -> (LanguageModel, ParameterCensus) {
        let mut model = model
            .with_in_backward(self.in_backward.clone())
            .with_loss_scale(self.loss_scale.clone());
        if let Some(schedule) = &mut self.block_coordinate {
            model = schedule.place(model);
        }
        let census = initialize_parameters(&model);
        (model, census)
    }
}

/// Draws every parameter's initial value that is not drawn yet (Burn draws lazily, at the first
/// read), in the model's own order, and counts them.
fn initialize_parameters(model: &LanguageModel) -> ParameterCensus {
    struct Draw;
    impl ModuleVisitor for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            param.val();
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            param.val();
        }
    }
    model.visit(&mut Draw);
    // Every parameter is drawn, so each reports its own type.
    ParameterCensus::of(model, DType::F32)
}
