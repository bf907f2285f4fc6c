//! The planner: which stacks fit in a given memory, cheapest in step time first.

use burn_memwall::memory::budget::{Budget, DeviceMemory};
use burn_memwall::memory::human_bytes;
use burn_memwall::optim::HalfPrecisionUpdate;

use crate::Error;
use crate::lm::{LmConfig, StepShape, step_budget};

use super::{NamedSwitches, every_stack};

/// Step time of each stack relative to `baseline`'s: the planner's cost table. Measured by
/// memgate, every stack in its own process (Flex, 2 cores, `small`, seq 256, batch 2, 5 timed
/// steps; the quantised stacks the median of three runs beside `baseline`; the `memwall`
/// stacks, with the saving ops since 2026-12-04, the median of three runs of 11 timed steps;
/// the `flash+fused+savers` stacks `flash+fused`'s times their median of five runs beside it,
/// with the norm's and SwiGLU's kernels, 2026-12-05; the `memwall-adam` stacks `memwall`'s
/// times their median of three runs beside it, 2026-12-05; `memwall-badam` likewise over a pass
/// of its blocks (two steps each), 2026-12-05; docs/BENCHMARKS.md, "The memory budget", "The
/// saving norm and MLP ops", "AdamW's moments in 8 or 4 bits" and "One block at a time").
/// Times on other shapes and devices differ (on `tiny` the
/// reversible stacks cost less, flash attention more).
const STEP_TIME: [(&str, f64); 26] = [
    ("baseline", 1.00),
    ("memwall", 1.12),
    ("memwall-sgd", 1.18),
    // memwall's 1.12 over their medians 0.885× and 0.904× of its speed.
    ("memwall-adam8", 1.27),
    ("memwall-adam4", 1.24),
    // memwall's 1.12 over its median 1.43× of memwall's tokens/s.
    ("memwall-badam", 0.78),
    // Not measurable on Flex, where it is refused; on lavapipe, whose bus is a `memcpy`, it ran
    // as fast as memwall (tiny, seq 64: median 283 against 247 tokens/s). A GPU's bus is not
    // measured yet: memwall's time, and `Plan::fitting` ranks it after the on-device stacks.
    ("memwall-offload", 1.12),
    // Likewise: on lavapipe as fast as memwall (small, seq 256: 79 against 74 tokens/s); the
    // host's AdamW and a GPU's bus are not measured yet.
    ("memwall-host-update", 1.12),
    ("flash-attention", 0.92),
    ("fused-loss", 0.95),
    ("flash+fused", 0.90),
    // flash+fused's 0.90 times their medians 0.87×, 0.99× and 0.98× of it, measured beside it
    // (int8 and int4 equal within the runs' noise).
    ("flash+fused+savers", 0.79),
    ("flash+fused+savers-int8", 0.89),
    ("flash+fused+savers-int4", 0.88),
    ("in-backward", 0.99),
    ("in-backward-fused-adamw", 0.93),
    ("in-backward-sgd", 0.93),
    ("in-backward-fused-sgd", 0.94),
    ("flash+fused+in-backward", 0.91),
    ("all-fused", 0.86),
    ("reversible", 1.17),
    ("reversible+flash+fused", 1.19),
    ("memwall-counter", 1.53),
    ("ternary", 1.11),
    ("counter", 1.17),
    ("counter+all-fused", 1.13),
];

/// One stack's predicted step.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub stack: NamedSwitches,
    /// The step's phases.
    pub budget: Budget,
    /// The budget's predicted peak.
    pub peak: u64,
    /// Step time relative to `baseline`'s (the planner's cost table).
    pub step_time: f64,
}

/// The predicted step of every stack the budget models, for one model and step shape.
#[derive(Clone, Debug)]
pub struct Plan {
    /// In the order of [`every_stack`].
    pub candidates: Vec<Candidate>,
    /// Stacks the budget does not model for this step (half precision and LoRA on pools;
    /// counter and ternary linears and low-bit saved activations in half precision or with
    /// LoRA) or that are refused there (the state in host memory on Flex), or whose step time
    /// is not measured, by name.
    pub not_modelled: Vec<&'static str>,
}

impl Plan {
    /// Predicts every stack of [`every_stack`] for `config` (its switches are each stack's) on
    /// steps of `shape`, its half-precision weights updated as `half_precision` says, on a
    /// device that holds tensors as `memory` does.
    ///
    /// # Errors
    /// [`Error::SequenceTooLong`] when `shape.seq` is over the model's context.
    pub fn new(
        config: &LmConfig,
        shape: StepShape,
        half_precision: Option<HalfPrecisionUpdate>,
        memory: DeviceMemory,
    ) -> Result<Self, Error> {
        Self::of_stacks(config, shape, half_precision, memory, every_stack())
    }

    /// [`Self::new`] for `stacks` (each named as in [`every_stack`], for its step time), such
    /// as each stack [`NamedSwitches::with_weights_on_host`].
    ///
    /// # Errors
    /// [`Error::SequenceTooLong`] when `shape.seq` is over the model's context.
    pub fn of_stacks(
        config: &LmConfig,
        shape: StepShape,
        half_precision: Option<HalfPrecisionUpdate>,
        memory: DeviceMemory,
        stacks: impl IntoIterator<Item = NamedSwitches>,
    ) -> Result<Self, Error> {
        let (mut candidates, mut not_modelled) = (Vec::new(), Vec::new());
        for stack in stacks {
            let Some(&(_, step_time)) = STEP_TIME.iter().find(|(name, _)| *name == stack.name)
            else {
                not_modelled.push(stack.name);
                continue;
            };
            let mut config = config.clone();
            stack.switches.apply(&mut config);
            let plan = stack.switches.optimizer_plan(half_precision);
            let budget = match step_budget(&config, &plan, shape, memory) {
                Ok(budget) => budget,
                // The parts whose memory is not modelled (on this device).
                Err(Error::InvalidConfig(_)) => {
                    not_modelled.push(stack.name);
                    continue;
                }
                Err(error) => return Err(error),
            };
            candidates.push(Candidate {
                stack,
                peak: budget.peak(),
                budget,
                step_time,
            });
        }
        Ok(Self {
            candidates,
            not_modelled,
        })
    }

    /// The stacks whose predicted peak is at most `available` bytes, cheapest in step time
    /// first (the smaller peak first among equals), in three tiers: the stacks that keep their
    /// optimizer state on the device, then those that keep it in host memory (each step moves
    /// it over the bus, which the cost table, measured where the bus is a `memcpy`, does not
    /// see), then those that train one block at a time (their steps are cheaper, but each
    /// moves one block).
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when none fits, naming the smallest budget that would work and
    /// its stack.
    pub fn fitting(&self, available: u64) -> Result<Vec<&Candidate>, Error> {
        let mut fitting: Vec<&Candidate> = self
            .candidates
            .iter()
            .filter(|candidate| candidate.peak <= available)
            .collect();
        if fitting.is_empty() {
            let smallest = self.smallest();
            return Err(Error::DoesNotFit(format!(
                "no stack fits in {}: the smallest predicted peak is {} (`{}`)",
                human_bytes(available),
                human_bytes(smallest.peak),
                smallest.stack.name
            )));
        }
        fitting.sort_by(|a, b| {
            tier(a)
                .cmp(&tier(b))
                .then(a.step_time.total_cmp(&b.step_time))
                .then(a.peak.cmp(&b.peak))
        });
        Ok(fitting)
    }

    /// The stack with the smallest predicted peak.
    pub fn smallest(&self) -> &Candidate {
        self.candidates
            .iter()
            .min_by_key(|candidate| candidate.peak)
            .expect("every plan models the baseline")
    }
}

/// `candidate`'s tier in [`Plan::fitting`]'s order: 0 with the optimizer state on the device,
/// 1 with it in host memory, 2 one block at a time.
fn tier(candidate: &Candidate) -> u8 {
    let switches = candidate.stack.switches;
    match (switches.block_coordinate.is_some(), switches.host_offload) {
        (true, _) => 2,
        (false, Some(_)) => 1,
        (false, None) => 0,
    }
}
