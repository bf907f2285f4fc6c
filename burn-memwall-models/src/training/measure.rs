//! Peak memory and speed of plain training steps (no Learner in between), for `memgate`.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn_memwall::memory::{MemoryMeter, PoolBreakdown};

use crate::Error;
use crate::data::{LmBatch, LmBatcher};
use crate::lm::{LanguageModel, LmConfig};

/// What a few training steps of one stack measured.
#[derive(Clone, Copy, Debug)]
pub struct StepMeasurement {
    /// The highest step peak, split into pools. `gradients` is computed (one f32 per parameter,
    /// all alive before the optimizer step); `persistent` is measured after the last step.
    pub pools: PoolBreakdown,
    /// Tokens per second over every step but the first (a warm-up).
    pub tokens_per_s: f64,
    /// Loss of the last step.
    pub loss: f32,
}

/// Trains `steps` steps of the baseline stack (Burn attention, full logits + cross-entropy,
/// AdamW) on consecutive batches of `windows` and measures each step.
///
/// The peak counts everything allocated after the call starts; on Cube devices pool peaks cannot
/// be reset, so run one measurement per process there.
pub fn measure_baseline_steps(
    config: &LmConfig,
    windows: &[Vec<u32>],
    batch_size: usize,
    steps: usize,
    learning_rate: f64,
    seed: u64,
    device: &Device,
) -> Result<StepMeasurement, Error> {
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
    warm_up_runtime(config, windows, batch_size, &train_device)?;
    let meter = MemoryMeter::new(device);
    let start_bytes = meter.live_bytes();
    device.seed(seed);
    let mut model = config.init(&train_device)?;
    let mut optimizer = AdamWConfig::new().init();
    let parameter_bytes = (model.num_params() * size_of::<f32>()) as u64;

    let (mut peak, mut timed_seconds, mut loss) = (0u64, 0.0f64, f32::NAN);
    for step in 0..steps {
        let first = (step * batch_size) % (windows.len() - batch_size + 1);
        let batch = LmBatcher::batch_windows(&windows[first..first + batch_size], &train_device);
        meter.reset_peak();
        let started = Instant::now();
        let step_loss;
        (model, step_loss) = train_step(model, &mut optimizer, batch, learning_rate);
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
    let optimizer_state = persistent.saturating_sub(parameter_bytes);
    let seq_len = windows[0].len() - 1;
    Ok(StepMeasurement {
        pools: PoolBreakdown::new(peak, parameter_bytes, optimizer_state, parameter_bytes),
        tokens_per_s: ((steps - 1) * batch_size * seq_len) as f64 / timed_seconds,
        loss,
    })
}

/// One throwaway step of the same model and batch shape, so that what the runtime allocates
/// once and keeps (thread pools, per-thread matmul scratch sized by the largest product, the
/// autodiff server) is not counted as the measured model's persistent state.
fn warm_up_runtime(
    config: &LmConfig,
    windows: &[Vec<u32>],
    batch_size: usize,
    device: &Device,
) -> Result<(), Error> {
    let batch = LmBatcher::batch_windows(&windows[..batch_size], device);
    train_step(
        config.init(device)?,
        &mut AdamWConfig::new().init(),
        batch,
        1e-3,
    );
    Ok(())
}

/// One baseline step: loss, backward, AdamW update. Returns the updated model and the loss.
fn train_step(
    model: LanguageModel,
    optimizer: &mut ModuleOptimizer,
    batch: LmBatch,
    learning_rate: f64,
) -> (LanguageModel, Tensor<1>) {
    let loss = model.loss(batch.inputs, batch.targets);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    (optimizer.step(learning_rate, model, grads), loss)
}
