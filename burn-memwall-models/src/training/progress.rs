//! Plain progress output for the Learner: a bar per split with the running loss and tokens/s,
//! one line per finished epoch, and the numbers kept for the final summary.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
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

/// Renders training progress and records each epoch into a shared list.
pub struct ProgressRenderer {
    metric_names: HashMap<MetricId, String>,
    records: Arc<Mutex<Vec<EpochRecord>>>,
    current: EpochRecord,
    split: String,
    split_start: Instant,
    items: usize,
    tokens_per_item: usize,
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl ProgressRenderer {
    /// `tokens_per_item` converts items (windows) into tokens for the speed; with `quiet` only
    /// the records are kept (for tests).
    pub fn new(tokens_per_item: usize, quiet: bool) -> (Self, Arc<Mutex<Vec<EpochRecord>>>) {
        let records = Arc::new(Mutex::new(Vec::new()));
        let renderer = Self {
            metric_names: HashMap::new(),
            records: records.clone(),
            current: EpochRecord::default(),
            split: String::new(),
            split_start: Instant::now(),
            items: 0,
            tokens_per_item,
            bar: None,
            quiet,
        };
        (renderer, records)
    }

    fn on_metric(&mut self, state: MetricState, split: &str) {
        let MetricState::Numeric(entry, Some(value)) = state else {
            return;
        };
        if self.metric_names.get(&entry.metric_id).map(String::as_str) != Some("Loss") {
            return;
        }
        match (value, split) {
            (NumericEntry::Final(loss), "train") => self.current.train_loss = loss,
            (NumericEntry::Final(loss), _) => self.current.valid_loss = loss,
            (running, _) => {
                if let Some(bar) = &self.bar {
                    bar.set_message(format!("loss {:.4}", running.current()));
                }
            }
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
                "epoch {:>3}  train loss {:.4}  valid loss {:.4}  {:.0} tokens/s",
                record.epoch, record.train_loss, record.valid_loss, record.train_tokens_per_s
            );
        }
        self.records.lock().expect("records lock").push(record);
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
