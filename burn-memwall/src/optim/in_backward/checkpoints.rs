//! The checkpoints of an [`InBackwardTraining`](super::InBackwardTraining) run: burn-train's
//! files (`{model,optim,scheduler}-N.bpk` in one folder, the records its `FileCheckpointer`
//! writes and reads), written on the training thread between epochs, when no step is alive,
//! and the model one tensor at a time.
//!
//! burn-train's `LearningCheckpointer` copies the whole model (`into_record`) and the whole
//! optimizer state (`to_record`) to the host, then writes them from its own threads while the
//! next epoch trains: a checkpoint of a 1.1B model with AdamW holds 12 GB beside the training
//! step. Here the model goes through burn-store's `BurnpackStore`, which reads each parameter
//! back only when the writer reaches it, so the model adds one parameter's bytes. The optimizer
//! record is still taken whole, because burn-optim 0.22.1 builds an `OptimizerRecord` only from
//! the whole state: with AdamW that is a copy of both moments, with SGD nothing.

use std::path::PathBuf;

use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::prelude::*;
use burn::store::{BurnpackStore, ModuleRecord, ModuleSnapshot};
use burn::train::checkpoint::{
    Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
    ComposedCheckpointingStrategy, FileCheckpointer, KeepLastNCheckpoints,
    MetricCheckpointingStrategy,
};
use burn::train::metric::LossMetric;
use burn::train::metric::store::{Aggregate, Direction, EventStoreClient, Split};

const MODEL: &str = "model";
const OPTIMIZER: &str = "optim";
const SCHEDULER: &str = "scheduler";

/// A run's checkpoint folder and the strategy that says which epochs it keeps.
pub(super) struct Checkpoints {
    folder: PathBuf,
    strategy: Box<dyn CheckpointingStrategy>,
}

impl Checkpoints {
    /// `folder` with burn-train's default strategy: the last two epochs and the one with the
    /// lowest mean validation loss.
    pub(super) fn new(folder: PathBuf) -> Self {
        let strategy = ComposedCheckpointingStrategy::builder()
            .add(KeepLastNCheckpoints::new(2))
            .add(MetricCheckpointingStrategy::new(
                &LossMetric::new(),
                Aggregate::Mean,
                Direction::Lowest,
                Split::Valid,
            ))
            .build();
        Self {
            folder,
            strategy: Box::new(strategy),
        }
    }

    fn file(&self, kind: &str) -> FileCheckpointer {
        FileCheckpointer::new(&self.folder, kind)
    }

    /// Saves `epoch` and deletes the epochs the strategy lets go.
    pub(super) fn checkpoint<M: Module>(
        &mut self,
        epoch: usize,
        events: &EventStoreClient,
        model: &M,
        optimizer: &ModuleOptimizer,
        scheduler: &ModuleLrScheduler,
    ) -> Result<(), CheckpointerError> {
        for action in self.strategy.checkpointing(epoch, events) {
            match action {
                CheckpointingAction::Save => self.save(epoch, model, optimizer, scheduler)?,
                CheckpointingAction::Delete(old) => self.delete(old)?,
            }
        }
        Ok(())
    }

    fn save<M: Module>(
        &self,
        epoch: usize,
        model: &M,
        optimizer: &ModuleOptimizer,
        scheduler: &ModuleLrScheduler,
    ) -> Result<(), CheckpointerError> {
        self.file(OPTIMIZER).save(epoch, optimizer.to_record())?;
        self.file(SCHEDULER).save(epoch, scheduler.to_record())?;
        // Written where `FileCheckpointer` would, so that `restore` and burn-train read it.
        let path = self.folder.join(format!("{MODEL}-{epoch}.bpk"));
        let mut store = BurnpackStore::from_file(path).overwrite(true);
        model
            .save_into(&mut store)
            .map_err(|error| CheckpointerError::Record(error.into()))
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        Checkpointer::<ModuleRecord>::delete(&self.file(MODEL), epoch)?;
        Checkpointer::<OptimizerRecord>::delete(&self.file(OPTIMIZER), epoch)?;
        Checkpointer::<LrSchedulerRecord>::delete(&self.file(SCHEDULER), epoch)
    }

    /// The model record of `epoch`.
    pub(super) fn model(&self, epoch: usize) -> Result<ModuleRecord, CheckpointerError> {
        self.file(MODEL).restore(epoch)
    }

    /// The optimizer and scheduler records of `epoch`.
    pub(super) fn optimizer_and_scheduler(
        &self,
        epoch: usize,
    ) -> Result<(OptimizerRecord, LrSchedulerRecord), CheckpointerError> {
        Ok((
            self.file(OPTIMIZER).restore(epoch)?,
            self.file(SCHEDULER).restore(epoch)?,
        ))
    }
}
