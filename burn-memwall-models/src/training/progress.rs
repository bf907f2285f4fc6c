//! Plain progress output for the Learner: a bar per split with the running loss and tokens/s,
//! one line per finished epoch, and the numbers kept for the final summary.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::curve::{LEARNING_RATE, LOSS};
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::{Interrupter, LearnerSummary};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What one epoch measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EpochRecord {
    pub epoch: usize,
    /// Token-weighted mean training loss of the epoch.
    pub train_loss: f64,
    /// Mean validation loss after the epoch.
    pub valid_loss: f64,
    /// Training tokens per second over the epoch's training split.
    pub train_tokens_per_s: f64,
}

/// What a run's progress recorded: every finished epoch, and the first step whose loss was not
/// finite, if one was.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProgressLog {
    pub epochs: Vec<EpochRecord>,
    /// `(step, loss)`, the step counted from 1 across the run (resumed epochs included).
    pub diverged: Option<(usize, f64)>,
}

/// Renders training progress (the loss and learning rate of each step, one line per epoch),
/// records each epoch into a shared [`ProgressLog`], and stops the run at the first step whose
/// loss is not finite.
pub struct ProgressRenderer {
    metric_names: HashMap<MetricId, String>,
    log: Arc<Mutex<ProgressLog>>,
    current: EpochRecord,
    /// The training steps before this one, resumed epochs included.
    steps: usize,
    learning_rate: Option<f64>,
    interrupter: Option<Interrupter>,
    split: String,
    split_start: Instant,
    items: usize,
    tokens_per_item: usize,
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl ProgressRenderer {
    /// `tokens_per_item` converts items (windows) into tokens for the speed; with `quiet` only
    /// the log is kept (for tests).
    pub fn new(tokens_per_item: usize, quiet: bool) -> (Self, Arc<Mutex<ProgressLog>>) {
        let log = Arc::new(Mutex::new(ProgressLog::default()));
        let renderer = Self {
            metric_names: HashMap::new(),
            log: log.clone(),
            current: EpochRecord::default(),
            steps: 0,
            learning_rate: None,
            interrupter: None,
            split: String::new(),
            split_start: Instant::now(),
            items: 0,
            tokens_per_item,
            bar: None,
            quiet,
        };
        (renderer, log)
    }

    /// Stops the run through `interrupter` at the first step whose loss is not finite, naming
    /// it in the log; `steps_before` counts the steps of the epochs a resume starts after.
    ///
    /// Burn's metrics reach the renderer from their own thread, so the steps already queued
    /// behind the bad one still run; the strategy's checkpoint waits for the metrics (an event
    /// flush) and sees the stop, so no checkpoint of that epoch is written.
    pub fn stopping_on_divergence(mut self, interrupter: Interrupter, steps_before: usize) -> Self {
        self.interrupter = Some(interrupter);
        self.steps = steps_before;
        self
    }

    fn on_metric(&mut self, state: MetricState, split: &str) {
        let MetricState::Numeric(entry, Some(value)) = state else {
            return;
        };
        match self.metric_names.get(&entry.metric_id).map(String::as_str) {
            Some(LOSS) => {}
            Some(LEARNING_RATE) => {
                if let NumericEntry::Value(rate) = value {
                    self.learning_rate = Some(rate);
                }
                return;
            }
            _ => return,
        }
        match (value, split) {
            (NumericEntry::Final(loss), "train") => self.current.train_loss = loss,
            (NumericEntry::Final(loss), _) => self.current.valid_loss = loss,
            (running, "train") => {
                self.steps += 1;
                let loss = running.current();
                if !loss.is_finite() {
                    self.on_divergence(loss);
                }
                if let Some(bar) = &self.bar {
                    bar.set_message(format!("loss {loss:.4}{}", self.rate_shown()));
                }
            }
            (running, _) => {
                if let Some(bar) = &self.bar {
                    bar.set_message(format!("loss {:.4}", running.current()));
                }
            }
        }
    }

    /// `  lr 1.000e-3` once a rate has been seen, for the end of a progress line.
    fn rate_shown(&self) -> String {
        self.learning_rate
            .map(|rate| format!("  lr {rate:.3e}"))
            .unwrap_or_default()
    }

    fn on_divergence(&mut self, loss: f64) {
        let Some(interrupter) = &self.interrupter else {
            return;
        };
        let mut log = self.log.lock().expect("progress log lock");
        if log.diverged.is_none() {
            log.diverged = Some((self.steps, loss));
            interrupter.stop(Some(&format!("the loss was {loss} at step {}", self.steps)));
        }
    }

    fn tokens_per_s(&self) -> f64 {
        (self.items * self.tokens_per_item) as f64
            / self.split_start.elapsed().as_secs_f64().max(1e-9)
    }
}

impl MetricsRendererTraining for ProgressRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.on_metric(state, "train");
    }

    fn update_valid(&mut self, state: MetricState) {
        self.on_metric(state, "valid");
    }

    fn on_train_end(
        &mut self,
        _: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for ProgressRenderer {
    fn start(&mut self, _: usize, starting_epoch: usize, _: Option<usize>, _: Option<&str>) {
        self.current.epoch = starting_epoch;
    }

    fn update_epoch(&mut self, epoch: usize) {
        let record = self.current;
        if !self.quiet {
            println!(
                "epoch {:>3}  train loss {:.4}  valid loss {:.4}  {:.0} tokens/s{}",
                record.epoch,
                record.train_loss,
                record.valid_loss,
                record.train_tokens_per_s,
                self.rate_shown()
            );
        }
        self.log
            .lock()
            .expect("progress log lock")
            .epochs
            .push(record);
        self.current = EpochRecord {
            epoch: epoch + 1,
            ..Default::default()
        };
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        self.split = split.to_owned();
        self.split_start = Instant::now();
        self.items = 0;
        let bar =
            ProgressBar::with_draw_target(Some(total_items as u64), ProgressDrawTarget::stderr());
        if self.quiet {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>12} [{bar:30}] {pos}/{len} windows  {msg}  {per_sec}",
            )
            .expect("static template")
            .progress_chars("=> "),
        );
        bar.set_prefix(format!("epoch {} {split}", self.current.epoch));
        self.bar = Some(bar);
    }

    fn update_split(&mut self, items_processed: usize) {
        self.items = items_processed;
        if let Some(bar) = &self.bar {
            bar.set_position(items_processed as u64);
        }
    }

    fn end_split(&mut self) {
        if self.split == "train" {
            self.current.train_tokens_per_s = self.tokens_per_s();
        }
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    fn end(&mut self) {}

    /// Burn sends "Iteration N" here every step; the bar already shows that.
    fn log_event_training(&mut self, _: String) {}
}

impl MetricsRendererEvaluation for ProgressRenderer {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
}

impl EvaluationProgressLogger for ProgressRenderer {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}

impl MetricsRenderer for ProgressRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.metric_names
            .insert(definition.metric_id, definition.name.to_string());
    }
}
