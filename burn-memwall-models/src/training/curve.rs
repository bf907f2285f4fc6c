//! The loss curve of a run, read back from the metric logs burn-train writes into its artifacts
//! folder (`train/epoch-N/Loss.log`, `train/epoch-N/Learning_Rate.log`,
//! `valid/epoch-N/Loss.log`).
//!
//! Each log line is a `NumericEntry`: one `loss,windows` line per batch, then one `loss,final`
//! line with the epoch's window-weighted mean. Burn rewrites an epoch's file when that epoch is
//! trained again, so after a resume the logs of epochs 1..=N are exactly those of the run's
//! checkpointed history.

use std::path::Path;

use burn::train::metric::NumericEntry;

use crate::Error;

/// The loss of every training step and the validation loss after every epoch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossCurve {
    /// `(step, loss)` for each training batch; steps count from 1 across epochs.
    pub train: Vec<(usize, f64)>,
    /// `(step, loss)` for each epoch: the last training step of the epoch and the epoch's mean
    /// validation loss.
    pub valid: Vec<(usize, f64)>,
    /// `(step, learning rate)` for each training batch.
    pub learning_rate: Vec<(usize, f64)>,
}

impl LossCurve {
    /// Reads epochs `1..=epochs` of the logs under `dir`.
    ///
    /// # Errors
    /// [`Error::Io`] if an epoch's training or validation log is missing, [`Error::Training`] if
    /// a line is not a metric entry or a validation log has no final entry.
    pub(crate) fn read(dir: &Path, epochs: usize) -> Result<Self, Error> {
        let mut curve = Self::default();
        for epoch in 1..=epochs {
            let first = curve.train.len() + 1;
            let (batches, _) = read_log(&log_path(dir, "train", epoch, LOSS))?;
            curve.train.extend((first..).zip(batches));
            let (rates, _) = read_log(&log_path(dir, "train", epoch, LEARNING_RATE))?;
            curve.learning_rate.extend((first..).zip(rates));
            let path = log_path(dir, "valid", epoch, LOSS);
            let (_, mean) = read_log(&path)?;
            let mean = mean.ok_or_else(|| {
                Error::Training(format!("{}: no final validation loss", path.display()))
            })?;
            curve.valid.push((curve.train.len(), mean));
        }
        Ok(curve)
    }
}

/// The names of burn-train's `LossMetric` and `LearningRateMetric`, which name their logs.
pub(super) const LOSS: &str = "Loss";
pub(super) const LEARNING_RATE: &str = "Learning Rate";

fn log_path(dir: &Path, split: &str, epoch: usize, metric: &str) -> std::path::PathBuf {
    dir.join(split)
        .join(format!("epoch-{epoch}"))
        // burn-train's file names have `_` for the metric name's spaces.
        .join(format!("{}.log", metric.replace(' ', "_")))
}

/// The loss of each batch and the epoch's final mean, if the epoch finished.
fn read_log(path: &Path) -> Result<(Vec<f64>, Option<f64>), Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut batches = Vec::new();
    let mut last = None;
    for line in text.lines().filter(|line| !line.is_empty()) {
        let entry = NumericEntry::deserialize(line)
            .map_err(|e| Error::Training(format!("{}: {line:?}: {e}", path.display())))?;
        match entry {
            NumericEntry::Aggregated {
                aggregated_value, ..
            } => batches.push(aggregated_value),
            NumericEntry::Value(value) => batches.push(value),
            NumericEntry::Final(value) => last = Some(value),
        }
    }
    Ok((batches, last))
}
