//! burn-train's single-device training loop, with the step holding the only handle on the
//! model, so that [`InBackward`](super::InBackward) keeps its gain through the `Learner`.
//!
//! Burn's own loop runs `self.model = self.model().optimize(..)` (burn-train 0.22.1,
//! `Learner::optimizer_step`): the Learner keeps its copy of the model while the step runs, so
//! every weight that the step updates in backward is written beside the old one, and the
//! gradient pool that in-backward updates remove comes back as a pool of new weights. The
//! Learner offers no way to let go of its copy, nor to reach its optimizer without it, so
//! [`InBackwardTraining`] takes the model out of the Learner it is launched with and owns the
//! optimizer and the learning-rate scheduler itself. Everything else is burn-train's: metrics,
//! the renderer, validation, the checkpointer (each epoch's model, optimizer and scheduler, in
//! the same files), early stopping, the interrupter, and `SupervisedTraining::checkpoint`'s
//! resume.

use std::path::PathBuf;
use std::sync::Mutex;

use burn::data::dataloader::{DataLoader, Progress};
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::ModuleOptimizer;
use burn::prelude::*;
use burn::train::checkpoint::{Checkpointer, FileCheckpointer};
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, ItemLazy, Learner, LearnerEvent,
    LearnerModel, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, ValidLoader,
};

use super::InBackwardError;
use crate::memory::MemoryMeter;

/// What the training steps of a run held, in the units of the [`MemoryMeter`] given to
/// [`InBackwardTraining::with_step_memory`]. Absolute readings: subtract what was live before
/// the run to get the run's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepMemory {
    /// The highest peak of one training step (forward, backward and update). On Flex each step
    /// starts a new peak window; a Cube pool's peak cannot be reset, so there it is the pool's
    /// high-water mark since the device started.
    pub peak_bytes: u64,
    /// What was live after the last training step: the model, the optimizer state and what the
    /// run keeps around them.
    pub live_bytes: u64,
}

/// A `SupervisedLearningStrategy` that trains on one device like burn-train's default, except
/// that the model it steps is held nowhere else. See the [module docs](self).
///
/// The Learner it is launched with supplies the model (loaded from the checkpoint on a resume);
/// give that Learner the same optimizer and scheduler as this strategy, so that burn-train's
/// resume finds what it expects. Any model trains with it; models routed through
/// [`InBackward`](super::InBackward) are the ones whose peak it changes.
///
/// ```ignore
/// let strategy = Arc::new(
///     InBackwardTraining::new(device.autodiff(), optimizer.clone(), lr)
///         .with_checkpoints(artifacts.join("checkpoint")),
/// );
/// SupervisedTraining::new(artifacts, train, valid)
///     .with_default_checkpointers()
///     .with_training_strategy(TrainingStrategy::Custom(strategy.clone()))
///     .launch(Learner::new(model, optimizer, lr));
/// ```
pub struct InBackwardTraining {
    device: Device,
    /// The optimizer and scheduler, until the run takes them.
    owned: Mutex<Option<(ModuleOptimizer, ModuleLrScheduler)>>,
    /// Where burn-train's default checkpointers write, for reading the optimizer and scheduler
    /// back on a resume.
    checkpoints: Option<PathBuf>,
    meter: Option<MemoryMeter>,
    memory: Mutex<Option<StepMemory>>,
}

impl InBackwardTraining {
    /// Trains on `device` (made an autodiff device if it is not one) with `optimizer` and
    /// `scheduler`.
    pub fn new(
        device: Device,
        optimizer: ModuleOptimizer,
        scheduler: impl Into<ModuleLrScheduler>,
    ) -> Self {
        let device = if device.is_autodiff() {
            device
        } else {
            device.autodiff()
        };
        Self {
            device,
            owned: Mutex::new(Some((optimizer, scheduler.into()))),
            checkpoints: None,
            meter: None,
            memory: Mutex::default(),
        }
    }

    /// The folder of `SupervisedTraining::with_default_checkpointers` (`<directory>/checkpoint`),
    /// from which a resume reads the optimizer and scheduler records. Needed for a resume.
    pub fn with_checkpoints(mut self, folder: impl Into<PathBuf>) -> Self {
        self.checkpoints = Some(folder.into());
        self
    }

    /// Reads `meter` around every training step; [`Self::step_memory`] reports it.
    pub fn with_step_memory(mut self, meter: MemoryMeter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// What the steps of the finished run held, if a meter was given.
    pub fn step_memory(&self) -> Option<StepMemory> {
        *self.memory.lock().expect("step memory lock")
    }

    /// The optimizer and scheduler, with their records from `epoch`'s checkpoint on a resume.
    fn take_owned(&self, resumed_epoch: Option<usize>) -> (ModuleOptimizer, ModuleLrScheduler) {
        let (optimizer, scheduler) = self
            .owned
            .lock()
            .expect("optimizer lock")
            .take()
            .expect("an InBackwardTraining strategy runs one training");
        let Some(epoch) = resumed_epoch else {
            return (optimizer, scheduler);
        };
        let folder = self.checkpoints.as_ref().expect(
            "resuming with InBackwardTraining needs `with_checkpoints(<directory>/checkpoint)`",
        );
        let restore = |name: &str| FileCheckpointer::new(folder, name);
        let optimizer_record = restore("optim")
            .restore(epoch)
            .unwrap_or_else(|error| panic!("cannot resume the optimizer: {error}"));
        let scheduler_record = restore("scheduler")
            .restore(epoch)
            .unwrap_or_else(|error| panic!("cannot resume the scheduler: {error}"));
        (
            optimizer.load_record(optimizer_record),
            scheduler.load_record(scheduler_record),
        )
    }

    fn record_step(&self, peak_bytes: u64, live_bytes: u64) {
        let mut memory = self.memory.lock().expect("step memory lock");
        let previous = memory.unwrap_or_default();
        *memory = Some(StepMemory {
            peak_bytes: previous.peak_bytes.max(peak_bytes),
            live_bytes,
        });
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for InBackwardTraining {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let TrainingComponents {
            num_epochs,
            checkpoint,
            mut checkpointer,
            grad_accumulation,
            interrupter,
            mut early_stopping,
            mut event_processor,
            event_store,
            ..
        } = components;
        assert!(
            grad_accumulation.is_none(),
            "{}",
            InBackwardError::GradientAccumulation
        );
        let mut model = learner.model().fork(&self.device);
        // The Learner's copy of the weights (and, on a resume, of the optimizer state it
        // loaded) goes before the run's own optimizer state is read.
        drop(learner);
        let (mut optimizer, mut scheduler) = self.take_owned(checkpoint);
        let train = dataloader_train.to_device(&self.device);
        let valid = dataloader_valid.to_device(&self.device.clone().inner());

        for epoch in starting_epoch..=num_epochs {
            interrupter.fail_on_error(event_processor.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: train.num_items(),
            }));
            for (item, progress, iteration) in items(&*train, &interrupter) {
                if let Some(meter) = &self.meter {
                    meter.reset_peak();
                }
                let output = TrainStep::step(&model, item);
                let lr = scheduler.step();
                model = model.optimize(&mut optimizer, lr.clone(), output.grads);
                if let Some(meter) = &self.meter {
                    self.record_step(meter.peak_bytes(), meter.live_bytes());
                }
                // Made ready here, on the training thread, so that the metric thread does not
                // read the device (see `ItemLazy`).
                let item = TrainingItem::new(output.item, progress, Some(iteration), Some(lr));
                match item.sync() {
                    Ok(item) => interrupter.fail_on_error(
                        event_processor.process_train(LearnerEvent::ProcessedItem(item)),
                    ),
                    Err(error) => panic!("the device failed during training: {error}"),
                }
            }
            interrupter.fail_on_error(event_processor.process_train(LearnerEvent::EndSplit(epoch)));
            if interrupter.should_stop() {
                break;
            }

            interrupter.fail_on_error(event_processor.process_valid(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: valid.num_items(),
            }));
            let valid_model = model.valid();
            for (item, progress, iteration) in items(&*valid, &interrupter) {
                let item = InferenceStep::step(&valid_model, item);
                let item = TrainingItem::new(item, progress, Some(iteration), None);
                match item.sync() {
                    Ok(item) => interrupter.fail_on_error(
                        event_processor.process_valid(LearnerEvent::ProcessedItem(item)),
                    ),
                    Err(error) => panic!("the device failed during validation: {error}"),
                }
            }
            drop(valid_model);
            interrupter.fail_on_error(event_processor.process_valid(LearnerEvent::EndSplit(epoch)));
            interrupter.fail_on_error(event_processor.process_train(LearnerEvent::EndEpoch(epoch)));
            if checkpointer.is_some() || early_stopping.is_some() {
                interrupter.fail_on_error(event_processor.flush());
            }
            if interrupter.should_stop() {
                break;
            }
            if let Some(checkpointer) = &mut checkpointer {
                // The checkpointer reads a Learner; this one holds the run's own parts for as
                // long as it takes to record them.
                let snapshot = Learner::new(model.clone(), optimizer.clone(), scheduler.clone());
                checkpointer.checkpoint(&snapshot, epoch, &event_store);
            }
            if let Some(early_stopping) = &mut early_stopping
                && early_stopping.should_stop(epoch, &event_store)
            {
                break;
            }
        }
        (model, event_processor)
    }
}

/// The items of `loader` with their progress and iteration (from 1), until the loader ends, an
/// item fails to load (the run then fails with its error), or the run is stopped.
fn items<'a, I>(
    loader: &'a dyn DataLoader<I>,
    interrupter: &'a Interrupter,
) -> impl Iterator<Item = (I, Progress, usize)> + 'a {
    let mut iterator = loader.iter();
    let mut iteration = 0;
    std::iter::from_fn(move || {
        if interrupter.should_stop() {
            return None;
        }
        match iterator.next()? {
            Ok(item) => {
                iteration += 1;
                Some((item, iterator.progress(), iteration))
            }
            Err(error) => {
                interrupter.fail(error);
                None
            }
        }
    })
}
