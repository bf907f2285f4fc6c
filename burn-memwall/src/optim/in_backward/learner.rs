//! [`InBackwardTraining`]; the type's docs are the description.

use std::path::PathBuf;
use std::sync::Mutex;

use burn::data::dataloader::{DataLoader, Progress};
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::ModuleOptimizer;
use burn::prelude::*;
use burn::train::checkpoint::CheckpointerError;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, ItemLazy, Learner, LearnerEvent,
    LearnerModel, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, ValidLoader,
};

use super::checkpoints::{CheckpointFiles, Checkpoints, RunExtras};
use super::{InBackward, InBackwardError};
use crate::memory::MemoryMeter;
use crate::optim::{BlockCoordinate, LossScale};

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
    /// The highest peak while a checkpoint was written, between epochs (0 if none was). On
    /// Cube, as `peak_bytes`, the pools' high-water mark.
    pub checkpoint_peak_bytes: u64,
}

/// A `SupervisedLearningStrategy` that trains on one device like burn-train's default, except
/// that the model it steps is held nowhere else.
///
/// The Learner it is launched with supplies the model; on a resume
/// (`SupervisedTraining::checkpoint(epoch)`) the strategy loads the model, optimizer and
/// scheduler of that epoch from its own checkpoint folder. Give it the checkpoint folder
/// instead of giving `SupervisedTraining` checkpointers. Any model trains with it; models
/// routed through [`InBackward`](super::InBackward) are the ones whose peak it changes.
///
/// ```ignore
/// let strategy = Arc::new(
///     InBackwardTraining::new(device.autodiff(), optimizer.clone(), lr)
///         .with_checkpoints(artifacts.join("checkpoint"))
///         .with_in_backward(in_backward.clone()),
/// );
/// SupervisedTraining::new(artifacts, train, valid)
///     .with_training_strategy(TrainingStrategy::Custom(strategy.clone()))
///     .launch(Learner::new(model, optimizer, lr));
/// ```
///
/// # Panics
/// In the run, if `SupervisedTraining` was given checkpointers, if a gradient accumulation is
/// set, or on a resume without [`Self::with_checkpoints`]. A checkpoint that cannot be written
/// or read stops the run with the error in the `LearningResult`.
///
/// burn-train's single-device training loop, with the step holding the only handle on the
/// model, so that [`InBackward`](super::InBackward) keeps its gain through the `Learner`.
///
/// Burn's own loop runs `self.model = self.model().optimize(..)` (burn-train 0.22.1,
/// `Learner::optimizer_step`): the Learner keeps its copy of the model while the step runs, so
/// every weight that the step updates in backward is written beside the old one, and the
/// gradient pool that in-backward updates remove comes back as a pool of new weights. The
/// Learner offers no way to let go of its copy, nor to reach its optimizer without it, so
/// [`InBackwardTraining`] takes the model out of the Learner it is launched with and owns the
/// optimizer and the learning-rate scheduler itself. It writes the checkpoints too (burn-train's
/// files, one model tensor at a time), since
/// burn-train's checkpointer would copy the whole model beside the next epoch's steps.
/// Everything else is burn-train's: metrics, the renderer, validation, early stopping, the
/// interrupter, and `SupervisedTraining::checkpoint(epoch)` to resume.
pub struct InBackwardTraining {
    device: Device,
    /// The optimizer and scheduler, until the run takes them.
    owned: Mutex<Option<(ModuleOptimizer, ModuleLrScheduler)>>,
    /// Where the checkpoints go, until the run takes them.
    checkpoints: Mutex<Option<Checkpoints>>,
    /// The handle the model routes through, whose optimizer state the run keeps per parameter.
    in_backward: Option<InBackward>,
    loss_scale: Option<LossScale>,
    /// The block schedule, until the run takes it.
    block_coordinate: Mutex<Option<BlockCoordinate>>,
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
            checkpoints: Mutex::default(),
            in_backward: None,
            loss_scale: None,
            block_coordinate: Mutex::default(),
            meter: None,
            memory: Mutex::default(),
        }
    }

    /// Writes a checkpoint into `folder` after each epoch and resumes from it: the files and
    /// records of burn-train's default checkpointers (`{model,optim,scheduler}-N.bpk`; use
    /// `<directory>/checkpoint` to put them where those would), keeping what burn-train keeps
    /// by default: the last two epochs and the one with the lowest validation loss.
    pub fn with_checkpoints(self, folder: impl Into<PathBuf>) -> Self {
        *self.checkpoints.lock().expect("checkpoints lock") = Some(Checkpoints::new(folder.into()));
        self
    }

    /// The [`InBackward`] handle the model routes its parameters through. The run then keeps
    /// each in-backward parameter's optimizer state in a `ModuleOptimizer` of its own (the
    /// same updates), so that a checkpoint writes it one parameter at a time instead of
    /// copying the whole state (see `in_backward/checkpoints.rs`); `optimizer` holds
    /// the state of the parameters updated after backward.
    pub fn with_in_backward(mut self, in_backward: InBackward) -> Self {
        self.in_backward = Some(in_backward);
        self
    }

    /// The scale of the model's losses (training in f16): checkpoints keep it, and a resume
    /// continues from it.
    pub fn with_loss_scale(mut self, loss_scale: LossScale) -> Self {
        self.loss_scale = Some(loss_scale);
        self
    }

    /// Trains one block of parameters at a time, as `schedule` says (BAdam): before each step
    /// the run freezes the other blocks and, at a switch, drops the optimizer state. Checkpoints
    /// keep the schedule's step (`block-coordinate-N.json`), and a resume continues it.
    pub fn with_block_coordinate(self, schedule: BlockCoordinate) -> Self {
        *self.block_coordinate.lock().expect("block coordinate lock") = Some(schedule);
        self
    }

    /// Reads `meter` around every training step; [`Self::step_memory`] reports it.
    pub fn with_step_memory(mut self, meter: MemoryMeter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// Reads back every file of `epoch`'s checkpoint in `folder` (as given to
    /// [`Self::with_checkpoints`]) but the model's, whose record only the model can check: the
    /// optimizer and scheduler records and the run's own `files`. A resume can then pick the
    /// newest epoch that loads whole rather than fail inside the run.
    ///
    /// # Errors
    /// The first file that is missing or does not decode.
    pub fn verify_checkpoint(
        folder: impl Into<PathBuf>,
        epoch: usize,
        files: CheckpointFiles,
    ) -> Result<(), CheckpointerError> {
        Checkpoints::new(folder.into()).verify(epoch, files)
    }

    /// What the steps of the finished run held, if a meter was given.
    pub fn step_memory(&self) -> Option<StepMemory> {
        *self.memory.lock().expect("step memory lock")
    }

    /// The optimizer and scheduler, which one run takes.
    fn take_owned(&self) -> (ModuleOptimizer, ModuleLrScheduler) {
        self.owned
            .lock()
            .expect("optimizer lock")
            .take()
            .expect("an InBackwardTraining strategy runs one training")
    }

    /// Runs `work` in a new peak window of the meter, if one was given, then lets `record` fold
    /// the meter's readings into the run's [`StepMemory`].
    fn measured<T>(
        &self,
        work: impl FnOnce() -> T,
        record: impl FnOnce(&mut StepMemory, &MemoryMeter),
    ) -> T {
        let Some(meter) = &self.meter else {
            return work();
        };
        meter.reset_peak();
        let result = work();
        let mut memory = self.memory.lock().expect("step memory lock");
        record(memory.get_or_insert_with(StepMemory::default), meter);
        result
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
            checkpointer,
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
        assert!(
            checkpointer.is_none(),
            "{}",
            InBackwardError::LearnerCheckpointer
        );
        let mut checkpoints = self.checkpoints.lock().expect("checkpoints lock").take();
        let mut block_coordinate = self
            .block_coordinate
            .lock()
            .expect("block coordinate lock")
            .take();
        // A schedule that keeps the waiting blocks' weights in host memory places the model
        // itself, once the learner's handle on it is gone (before a checkpoint's record loads,
        // which each parameter does where it is): a fork would draw every weight on the device
        // at once.
        let weights_on_host = block_coordinate
            .as_ref()
            .is_some_and(BlockCoordinate::keeps_inactive_weights_on_host);
        let model = match weights_on_host {
            true => learner.model(),
            false => learner.model().fork(&self.device),
        };
        drop(learner);
        let mut model = match &mut block_coordinate {
            Some(schedule) if weights_on_host => schedule.place(model),
            _ => model,
        };
        let (mut optimizer, mut scheduler) = self.take_owned();
        if let Some(in_backward) = &self.in_backward {
            in_backward.keep_state_per_parameter();
        }
        if let Some(epoch) = checkpoint {
            let checkpoints = checkpoints.as_ref().expect(
                "resuming with InBackwardTraining needs `with_checkpoints(<checkpoint folder>)`",
            );
            // The model first, so that its record is gone before the optimizer state is read.
            // A record that does not fit the model panics, as in burn-train's own resume.
            // Loaded in a persistent window, as `Param::from_data` makes a weight: outside one
            // the weights take the pools' pages, between the step's transients, for the rest of
            // the run.
            match checkpoints.model(epoch) {
                Ok(record) => {
                    model = self
                        .device
                        .memory_persistent_allocations((model, record), |(model, record)| {
                            model.load_record(record)
                        })
                }
                Err(error) => {
                    interrupter.fail(error);
                    return (model, event_processor);
                }
            }
            match checkpoints.optimizer_and_scheduler(epoch) {
                Ok((optimizer_record, scheduler_record)) => {
                    optimizer = optimizer.load_record(optimizer_record);
                    scheduler = scheduler.load_record(scheduler_record);
                }
                Err(error) => {
                    interrupter.fail(error);
                    return (model, event_processor);
                }
            }
            if let Some(in_backward) = &self.in_backward
                && let Err(error) =
                    checkpoints.restore_states_per_parameter(epoch, in_backward, &optimizer)
            {
                interrupter.fail(error);
                return (model, event_processor);
            }
            if let Some(scale) = &self.loss_scale {
                match checkpoints.loss_scale(epoch) {
                    Ok(record) => scale.load_record(record),
                    Err(error) => {
                        interrupter.fail(error);
                        return (model, event_processor);
                    }
                }
            }
            if let Some(schedule) = block_coordinate.take() {
                match checkpoints.block_coordinate(epoch) {
                    Ok(record) => block_coordinate = Some(schedule.load_record(record)),
                    Err(error) => {
                        interrupter.fail(error);
                        return (model, event_processor);
                    }
                }
            }
        }
        if let (Some(epoch), Some(checkpoints)) = (checkpoint, &mut checkpoints)
            && let Err(error) = checkpoints.replay(epoch, &event_store)
        {
            interrupter.fail(error);
            return (model, event_processor);
        }
        let train = dataloader_train.to_device(&self.device);
        let valid = dataloader_valid.to_device(&self.device.clone().inner());

        for epoch in starting_epoch..=num_epochs {
            interrupter.fail_on_error(event_processor.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: train.num_items(),
            }));
            for (item, progress, iteration) in items(&*train, &interrupter) {
                if let Some(schedule) = &mut block_coordinate {
                    model = schedule.begin_step(model, &mut optimizer, self.in_backward.as_ref());
                }
                let (stepped, output, lr) = self.measured(
                    || {
                        let output = TrainStep::step(&model, item);
                        let lr = scheduler.step();
                        let stepped = model.optimize(&mut optimizer, lr.clone(), output.grads);
                        (stepped, output.item, lr)
                    },
                    |memory, meter| {
                        memory.peak_bytes = memory.peak_bytes.max(meter.peak_bytes());
                        memory.live_bytes = meter.live_bytes();
                    },
                );
                model = stepped;
                // Made ready here, on the training thread, so that the metric thread does not
                // read the device (see `ItemLazy`).
                let item = TrainingItem::new(output, progress, Some(iteration), Some(lr));
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
            if checkpoints.is_some() || early_stopping.is_some() {
                interrupter.fail_on_error(event_processor.flush());
            }
            if interrupter.should_stop() {
                break;
            }
            if let Some(checkpoints) = &mut checkpoints {
                let saved = self.measured(
                    || {
                        checkpoints.checkpoint(
                            epoch,
                            &event_store,
                            &model,
                            &optimizer,
                            &scheduler,
                            RunExtras {
                                in_backward: self.in_backward.as_ref(),
                                loss_scale: self.loss_scale.as_ref(),
                                block_coordinate: block_coordinate.as_ref(),
                            },
                        )
                    },
                    |memory, meter| {
                        memory.checkpoint_peak_bytes =
                            memory.checkpoint_peak_bytes.max(meter.peak_bytes());
                    },
                );
                interrupter.fail_on_error(saved);
                if interrupter.should_stop() {
                    break;
                }
            }
            if let Some(early_stopping) = &mut early_stopping
                && early_stopping.should_stop(epoch, &event_store)
            {
                break;
            }
        }
        if let Some(schedule) = &block_coordinate {
            model = schedule.end(model);
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
