//! The checkpoints of an [`InBackwardTraining`](super::InBackwardTraining) run: burn-train's
//! files (`{model,optim,scheduler}-N.bpk` in one folder, the records its `FileCheckpointer`
//! writes and reads), written on the training thread between epochs, when no step is alive,
//! and the model one tensor at a time.
//!
//! burn-train's `LearningCheckpointer` copies the whole model (`into_record`) and the whole
//! optimizer state (`to_record`) to the host, then writes them from its own threads while the
//! next epoch trains: a checkpoint of a 1.1B model with AdamW holds 12 GB beside the training
//! step. Here the model goes through burn-store's `BurnpackStore`, which reads each parameter
//! back only when the writer reaches it, so the model adds one parameter's bytes.
//!
//! burn-optim 0.22.1 builds an `OptimizerRecord` only from a whole `ModuleOptimizer`'s state,
//! which for AdamW is two copies of the model. So a run given its [`InBackward`] handle keeps the
//! state of each parameter updated in backward in a `ModuleOptimizer` of its own
//! ([`InBackward::keep_state_per_parameter`]), and a checkpoint writes one record per parameter
//! into `optim-N-parameters/<param id>.bpk`, one after the other: it adds one parameter's state.
//! `optim-N.bpk` holds the rest (the parameters updated after backward), as burn-train writes it.
//!
//! A run with a [`LossScale`] keeps it in `loss-scale-N.json`, one with a [`BlockCoordinate`]
//! its step in `block-coordinate-N.json`.

use std::path::{Path, PathBuf};

use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::ParamId;
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
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::InBackward;
use crate::optim::{BlockCoordinate, BlockCoordinateRecord, LossScale, LossScaleRecord};

const MODEL: &str = "model";
const OPTIMIZER: &str = "optim";
const SCHEDULER: &str = "scheduler";
const LOSS_SCALE: &str = "loss-scale";
const BLOCK_COORDINATE: &str = "block-coordinate";

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

    /// The folder of `epoch`'s optimizer state kept per parameter.
    fn states_per_parameter(&self, epoch: usize) -> PathBuf {
        self.folder.join(format!("{OPTIMIZER}-{epoch}-parameters"))
    }

    /// The file of `epoch`'s record of `kind` kept in JSON.
    fn json_file(&self, kind: &str, epoch: usize) -> PathBuf {
        self.folder.join(format!("{kind}-{epoch}.json"))
    }

    fn save_json(
        &self,
        kind: &str,
        epoch: usize,
        record: &impl Serialize,
    ) -> Result<(), CheckpointerError> {
        let json = serde_json::to_vec(record)
            .map_err(|error| CheckpointerError::Unknown(error.to_string()))?;
        std::fs::write(self.json_file(kind, epoch), json).map_err(CheckpointerError::IOError)
    }

    /// `epoch`'s record of `kind`; `why` says why the run needs it, for when it is missing.
    fn load_json<T: DeserializeOwned>(
        &self,
        kind: &str,
        epoch: usize,
        why: &str,
    ) -> Result<T, CheckpointerError> {
        let path = self.json_file(kind, epoch);
        let unknown =
            |reason: String| CheckpointerError::Unknown(format!("{}: {reason}", path.display()));
        let json = std::fs::read(&path).map_err(|error| unknown(format!("{error}; {why}")))?;
        serde_json::from_slice(&json).map_err(|error| unknown(error.to_string()))
    }

    /// Saves `epoch` (with the optimizer state that `in_backward` keeps per parameter and the
    /// loss scale, if given) and deletes the epochs the strategy lets go.
    pub(super) fn checkpoint<M: Module>(
        &mut self,
        epoch: usize,
        events: &EventStoreClient,
        model: &M,
        optimizer: &ModuleOptimizer,
        scheduler: &ModuleLrScheduler,
        extras: RunExtras<'_>,
    ) -> Result<(), CheckpointerError> {
        for action in self.strategy.checkpointing(epoch, events) {
            match action {
                CheckpointingAction::Save => {
                    if let Some(in_backward) = extras.in_backward {
                        self.save_states_per_parameter(epoch, in_backward)?;
                    }
                    if let Some(scale) = extras.loss_scale {
                        self.save_json(LOSS_SCALE, epoch, &scale.to_record())?;
                    }
                    if let Some(schedule) = extras.block_coordinate {
                        self.save_json(BLOCK_COORDINATE, epoch, &schedule.to_record())?;
                    }
                    self.save(epoch, model, optimizer, scheduler)?;
                }
                CheckpointingAction::Delete(old) => self.delete(old)?,
            }
        }
        Ok(())
    }

    /// Brings the strategy up to a run resumed after `epoch`, deleting what it lets go.
    ///
    /// burn-train's strategies hold what they have seen in memory: an epoch is deleted once
    /// every strategy has let it go, and the best-validation one lets an epoch go only after it
    /// has seen it. A resumed run's strategies have seen none of the epochs before it, so
    /// without this those epochs' checkpoints would be kept forever. The validation losses they
    /// compare come from the run's metric logs on disk.
    pub(super) fn replay(
        &mut self,
        epoch: usize,
        events: &EventStoreClient,
    ) -> Result<(), CheckpointerError> {
        for seen in 1..=epoch {
            for action in self.strategy.checkpointing(seen, events) {
                if let CheckpointingAction::Delete(old) = action
                    && old != epoch
                {
                    self.delete(old)?;
                }
            }
        }
        Ok(())
    }

    /// Written into a scratch folder that is renamed when complete, so that a folder under the
    /// final name is always whole.
    fn save_states_per_parameter(
        &self,
        epoch: usize,
        in_backward: &InBackward,
    ) -> Result<(), CheckpointerError> {
        let done = self.states_per_parameter(epoch);
        let scratch = done.with_extension("partial");
        remove_folder(&scratch)?;
        std::fs::create_dir_all(&scratch).map_err(CheckpointerError::IOError)?;
        in_backward.visit_states_per_parameter(|id, optimizer| {
            optimizer
                .to_record()
                .save(scratch.join(format!("{}.bpk", id.val())))
                .map_err(CheckpointerError::Record)
        })?;
        remove_folder(&done)?;
        std::fs::rename(&scratch, &done).map_err(CheckpointerError::IOError)
    }

    /// The model last: once its file is there, the rest of the epoch is.
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
        Checkpointer::<LrSchedulerRecord>::delete(&self.file(SCHEDULER), epoch)?;
        for kind in [LOSS_SCALE, BLOCK_COORDINATE] {
            match std::fs::remove_file(self.json_file(kind, epoch)) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    return Err(CheckpointerError::IOError(error));
                }
                _ => {}
            }
        }
        remove_folder(&self.states_per_parameter(epoch))
    }

    /// The loss scale of `epoch`.
    pub(super) fn loss_scale(&self, epoch: usize) -> Result<LossScaleRecord, CheckpointerError> {
        self.load_json(
            LOSS_SCALE,
            epoch,
            "the run scales its loss, and a checkpoint written without its scale would resume \
             at another",
        )
    }

    /// The block schedule's step of `epoch`.
    pub(super) fn block_coordinate(
        &self,
        epoch: usize,
    ) -> Result<BlockCoordinateRecord, CheckpointerError> {
        self.load_json(
            BLOCK_COORDINATE,
            epoch,
            "the run trains one block at a time, and a checkpoint written without its step \
             would resume at another block",
        )
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

    /// Loads `epoch`'s optimizer state kept per parameter into `in_backward`, one parameter at
    /// a time, each into a `ModuleOptimizer` made from `template`.
    pub(super) fn restore_states_per_parameter(
        &self,
        epoch: usize,
        in_backward: &InBackward,
        template: &ModuleOptimizer,
    ) -> Result<(), CheckpointerError> {
        in_backward.load_states_per_parameter(template, self.states_per_parameter_records(epoch)?)
    }

    /// Reads back every file of `epoch` but the model's, and drops what it read: the optimizer
    /// and scheduler records and those of `files`.
    pub(super) fn verify(
        &self,
        epoch: usize,
        files: CheckpointFiles,
    ) -> Result<(), CheckpointerError> {
        self.optimizer_and_scheduler(epoch)?;
        if files.states_per_parameter {
            for record in self.states_per_parameter_records(epoch)? {
                record?;
            }
        }
        if files.loss_scale {
            self.loss_scale(epoch)?;
        }
        if files.block_coordinate {
            self.block_coordinate(epoch)?;
        }
        Ok(())
    }

    /// `epoch`'s optimizer state kept per parameter, read one parameter at a time as the
    /// iterator is driven.
    fn states_per_parameter_records(
        &self,
        epoch: usize,
    ) -> Result<
        impl Iterator<Item = Result<(ParamId, OptimizerRecord), CheckpointerError>> + use<>,
        CheckpointerError,
    > {
        let folder = self.states_per_parameter(epoch);
        let unknown = |reason: String| CheckpointerError::Unknown(reason);
        let entries = std::fs::read_dir(&folder).map_err(|error| {
            unknown(format!(
                "{}: {error}; the run keeps its optimizer state per parameter, and a checkpoint \
                 written without it would resume with none",
                folder.display()
            ))
        })?;
        let records = entries.map(move |entry| {
            let path = entry.map_err(CheckpointerError::IOError)?.path();
            let id = path
                .file_stem()
                .and_then(|stem| stem.to_str()?.parse::<u64>().ok())
                .ok_or_else(|| unknown(format!("{}: not a parameter id", path.display())))?;
            let record = OptimizerRecord::load(&path).map_err(CheckpointerError::Record)?;
            Ok((ParamId::from(id), record))
        });
        Ok(records)
    }
}

/// What a run keeps beside the model, optimizer and scheduler, when it has them.
#[derive(Clone, Copy)]
pub(super) struct RunExtras<'a> {
    /// The handle whose per-parameter optimizer state is saved.
    pub(super) in_backward: Option<&'a InBackward>,
    /// The loss scale.
    pub(super) loss_scale: Option<&'a LossScale>,
    /// The block schedule.
    pub(super) block_coordinate: Option<&'a BlockCoordinate>,
}

/// Which of its own files an [`InBackwardTraining`](super::InBackwardTraining) checkpoint holds
/// beside burn-train's model, optimizer and scheduler records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointFiles {
    /// Each in-backward parameter's optimizer state: a run given `with_in_backward`.
    pub states_per_parameter: bool,
    /// The loss scale: a run given `with_loss_scale`.
    pub loss_scale: bool,
    /// The block schedule's step: a run given `with_block_coordinate`.
    pub block_coordinate: bool,
}

/// Removes `folder` and what it holds, if it is there.
fn remove_folder(folder: &Path) -> Result<(), CheckpointerError> {
    match std::fs::remove_dir_all(folder) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(CheckpointerError::IOError(error))
        }
        _ => Ok(()),
    }
}
