//! The learning rate over a run: an optional linear warm-up, an optional cosine decay, then a
//! constant rate. Built from Burn's schedulers, whose record the checkpoints keep, so a resume
//! continues the schedule where it stopped. The decay has its own length rather than the run's,
//! so that a run resumed with more epochs follows the same schedule as one that was planned
//! that long.

use burn::lr_scheduler::LrSchedulerConfig;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::lr_scheduler::sequential::SequentialLrSchedulerConfig;

use super::TrainingConfig;
use crate::Error;

impl TrainingConfig {
    /// The scheduler of the learning rate: `warmup_steps` from `learning_rate / warmup_steps`
    /// up to `learning_rate`, then `decay_steps` of cosine down to `final_learning_rate`, which
    /// then stays; with no decay, `learning_rate` stays.
    ///
    /// # Errors
    /// If a rate is outside Burn's range (`learning_rate` in (0, 1], `final_learning_rate` in
    /// [0, `learning_rate`]).
    pub fn lr_scheduler(&self) -> Result<ModuleLrScheduler, Error> {
        let peak = self.learning_rate;
        let mut phases = Vec::new();
        let mut milestones = Vec::new();
        let mut steps = 0;
        if self.warmup_steps > 0 {
            let start = peak / self.warmup_steps as f64;
            phases.push(LrSchedulerConfig::Linear(LinearLrSchedulerConfig::new(
                start,
                peak,
                self.warmup_steps,
            )));
            steps += self.warmup_steps;
            milestones.push(steps);
        }
        let last = if self.decay_steps > 0 {
            phases.push(LrSchedulerConfig::Cosine(
                CosineAnnealingLrSchedulerConfig::new(peak, self.decay_steps)
                    .with_min_lr(self.final_learning_rate),
            ));
            steps += self.decay_steps;
            milestones.push(steps);
            self.final_learning_rate
        } else {
            peak
        };
        // Burn's cosine climbs back after its last step; the schedule stays at its end.
        phases.push(LrSchedulerConfig::Constant(last));
        SequentialLrSchedulerConfig::new(phases, milestones)
            .init()
            .map_err(|reason| Error::Training(format!("learning-rate schedule: {reason}")))
    }
}

#[cfg(test)]
mod tests {
    use std::f64::consts::PI;

    use burn::module::ParamId;

    use super::*;

    /// The rate of step `t` (from 0), written out from the schedule's definition in f64.
    fn expected(config: &TrainingConfig, t: usize) -> f64 {
        let (peak, warmup, decay) = (
            config.learning_rate,
            config.warmup_steps,
            config.decay_steps,
        );
        if t < warmup {
            let start = peak / warmup as f64;
            return start + (peak - start) * t as f64 / warmup as f64;
        }
        let t = t - warmup;
        if decay == 0 {
            return peak;
        }
        let floor = config.final_learning_rate;
        if t >= decay {
            return floor;
        }
        floor + 0.5 * (peak - floor) * (1.0 + (PI * t as f64 / decay as f64).cos())
    }

    #[test]
    fn the_schedule_warms_up_decays_and_stays() {
        for (warmup, decay) in [(0, 0), (4, 0), (0, 6), (4, 6)] {
            let config = TrainingConfig::new()
                .with_learning_rate(1e-2)
                .with_warmup_steps(warmup)
                .with_decay_steps(decay)
                .with_final_learning_rate(1e-3);
            let mut scheduler = config.lr_scheduler().unwrap();
            for t in 0..warmup + decay + 5 {
                let got = scheduler.step().lr_from_param(ParamId::new(), None);
                let want = expected(&config, t);
                assert!(
                    (got - want).abs() <= 1e-12,
                    "warm-up {warmup}, decay {decay}: step {t} has rate {got}, expected {want}"
                );
            }
        }
    }

    #[test]
    fn rates_outside_burns_range_are_errors() {
        let config = TrainingConfig::new()
            .with_learning_rate(1e-2)
            .with_decay_steps(10)
            .with_final_learning_rate(2e-2);
        let error = config
            .lr_scheduler()
            .err()
            .expect("a final rate above the peak");
        assert!(
            error.to_string().contains("learning-rate schedule"),
            "{error}"
        );
    }
}
