//! Peak memory and speed of plain training steps (no Learner in between), for `memgate`.

use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::prelude::*;
use burn_memwall::memory::{MemoryMeter, PoolBreakdown};
use burn_memwall::optim::train_step;

use crate::Error;
use crate::data::LmBatcher;
use crate::lm::LanguageModel;

use super::stepping::Stepping;
use super::{RunConfig, TrainingConfig};

/// What a few training steps of one stack measured.
#[derive(Clone, Copy, Debug)]
pub struct StepMeasurement {
    /// The highest step peak, split into pools. `gradients` is computed: one f32 per parameter
    /// (all alive before the optimizer step), or in backward the largest parameter's (one at a
    /// time); `persistent` is measured after the last step, and `parameters` then are those on
    /// the device (not those a block schedule keeps waiting in host memory).
    pub pools: PoolBreakdown,
    /// What the forward pass leaves alive for the backward pass (saved activations and the
    /// graph), measured at the loss: the most over the timed steps. (The warm-up step's
    /// forward can keep one-time allocations: a reversible chain's first training forward, for
    /// one, keeps about its couplings' parameter bytes more.)
    pub saved_activations: u64,
    /// Tokens per second over every step but the first (a warm-up).
    pub tokens_per_s: f64,
    /// Loss of the last step.
    pub loss: f32,
}

/// Trains `steps` steps of `run` (its model with its LoRA adapters, drawn, not its base's
/// weights; its optimizer, precision, batch size, learning rate, weight decay and seed) on
/// consecutive batches of `windows` and measures each step. `device` must compute in the run's
/// precision.
///
/// The peak counts everything allocated after the call starts; on Cube devices pool peaks cannot
/// be reset, so run one measurement per process there.
pub fn measure_training_steps(
    run: &RunConfig,
    windows: &[Vec<u32>],
    steps: usize,
    device: &Device,
) -> Result<StepMeasurement, Error> {
    run.validate()?;
    let config = &run.model;
    let TrainingConfig {
        precision,
        batch_size,
        learning_rate,
        seed,
        ..
    } = run.training;
    if steps < 2 {
        return Err(Error::Training(
            "measure at least 2 steps (the first is an untimed warm-up)".into(),
        ));
    }
    if let Some(window) = windows.first()
        && window.len() - 1 > config.max_seq_len
    {
        return Err(Error::SequenceTooLong {
            seq_len: window.len() - 1,
            max_seq_len: config.max_seq_len,
        });
    }
    if windows.len() < batch_size || batch_size == 0 {
        return Err(Error::Data(format!(
            "{} windows do not fill one batch of {batch_size}",
            windows.len()
        )));
    }
    let train_device = device.clone().autodiff();
    warm_up_runtime(run, windows, device)?;
    let meter = MemoryMeter::new(device);
    let start_bytes = meter.live_bytes();
    device.seed(seed);
    let mut stepping = run.stepping(device)?;
    let (mut model, sizes) = stepping.prepare(run.initial_model(&train_device, false)?);
    // Gradients of the trained parameters: all at once after backward, or one at a time in it.
    let gradient_bytes = run
        .training
        .optimizer
        .plan(precision.half_update())
        .gradients(&sizes)
        .bytes();
    let Stepping {
        mut optimizer,
        mut block_coordinate,
        ..
    } = stepping;

    let (mut peak, mut saved_activations) = (0u64, 0u64);
    let (mut timed_seconds, mut loss) = (0.0f64, f32::NAN);
    for step in 0..steps {
        let first = (step * batch_size) % (windows.len() - batch_size + 1);
        let batch = LmBatcher::batch_windows(&windows[first..first + batch_size], &train_device);
        meter.reset_peak();
        let started = Instant::now();
        if let Some(schedule) = &mut block_coordinate {
            model = schedule.begin_step(model, &mut optimizer, None);
        }
        let before_forward = meter.live_bytes();
        let step_loss = model.loss(batch.inputs, batch.targets);
        if step > 0 {
            saved_activations =
                saved_activations.max(meter.live_bytes().saturating_sub(before_forward));
        }
        model = update(model, &mut optimizer, step_loss.clone(), learning_rate);
        loss = step_loss.into_scalar::<f32>();
        // The loss is ready before the backward pass and the update are: wait for them too.
        device
            .sync()
            .map_err(|error| Error::Training(format!("the device failed: {error:?}")))?;
        if step > 0 {
            timed_seconds += started.elapsed().as_secs_f64();
        }
        peak = peak.max(meter.peak_bytes().saturating_sub(start_bytes));
    }
    if !loss.is_finite() {
        return Err(Error::Training(format!(
            "the loss is {loss} after {steps} steps"
        )));
    }
    let persistent = meter.live_bytes().saturating_sub(start_bytes);
    let parameter_bytes = sizes.bytes() - bytes_waiting_elsewhere(&model, &meter);
    let optimizer_state = persistent.saturating_sub(parameter_bytes);
    let seq_len = windows[0].len() - 1;
    Ok(StepMeasurement {
        pools: PoolBreakdown::new(peak, parameter_bytes, optimizer_state, gradient_bytes),
        saved_activations,
        tokens_per_s: ((steps - 1) * batch_size * seq_len) as f64 / timed_seconds,
        loss,
    })
}

/// One throwaway step of the same model and batch shape, so that what the runtime allocates
/// once and keeps (thread pools, per-thread matmul scratch sized by the largest product, the
/// autodiff server) is not counted as the measured model's persistent state.
fn warm_up_runtime(run: &RunConfig, windows: &[Vec<u32>], device: &Device) -> Result<(), Error> {
    let train_device = device.clone().autodiff();
    let batch = LmBatcher::batch_windows(&windows[..run.training.batch_size], &train_device);
    let mut stepping = run.stepping(device)?;
    let (mut model, _) = stepping.prepare(run.initial_model(&train_device, false)?);
    let mut optimizer = stepping.optimizer;
    // Trained one block at a time here too: a Cube pool would keep every block's state reserved.
    if let Some(schedule) = &mut stepping.block_coordinate {
        model = schedule.begin_step(model, &mut optimizer, None);
    }
    let loss = model.loss(batch.inputs, batch.targets);
    update(model, &mut optimizer, loss, 1e-3);
    // A worker that ran no product in the throwaway step would allocate its matmul scratch in
    // a measured one (in about one `tiny` run in four).
    MemoryMeter::new(device).warm_matmul_threads();
    Ok(())
}

/// Backward and update (during backward when the model is routed through an [`InBackward`]).
fn update(
    model: LanguageModel,
    optimizer: &mut ModuleOptimizer,
    loss: Tensor<1>,
    learning_rate: f64,
) -> LanguageModel {
    let in_backward = model.in_backward().cloned();
    let loss = model.backward_loss(loss);
    let model = train_step(in_backward.as_ref(), optimizer, learning_rate, model, loss)
        .expect("a model on an autodiff device");
    model.end_step();
    model
}

/// Bytes of `model`'s weights waiting in host memory, outside what `meter` reads.
fn bytes_waiting_elsewhere(model: &LanguageModel, meter: &MemoryMeter) -> u64 {
    struct Waiting<'a>(&'a MemoryMeter, u64);
    impl ModuleVisitor for Waiting<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if !self.0.holds(&value) {
                self.1 += (value.shape().num_elements() * value.dtype().size()) as u64;
            }
        }
    }
    let mut waiting = Waiting(meter, 0);
    model.visit(&mut waiting);
    waiting.1
}
