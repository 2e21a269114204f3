"""keras-ft: fault-tolerant Keras 3 `model.fit()`."""

from keras_ft.callback import BackupAndRestore
from keras_ft.cluster import TaskSpec, current_task
from keras_ft.compat import CompatibilityWarning, install_multi_worker_fixes
from keras_ft.lock import DirectoryInUseError
from keras_ft.policy import (
    AnyOf,
    EveryEpoch,
    EveryNSeconds,
    EveryNSteps,
    KeepLast,
    OverheadBudget,
    SaveSchedule,
)
from keras_ft.state import NonFiniteStateError, ResumePoint, TrainingState
from keras_ft.store import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    CheckpointWriteError,
    CorruptCheckpointError,
    NoGoodCheckpointError,
)
from keras_ft.worker_training_state import WorkerTrainingState, wait_for_backups

__version__ = "0.1.0"

__all__ = [
    "AnyOf",
    "BackupAndRestore",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriteError",
    "CompatibilityWarning",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "EveryEpoch",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepLast",
    "NoGoodCheckpointError",
    "NonFiniteStateError",
    "OverheadBudget",
    "ResumePoint",
    "SaveSchedule",
    "TaskSpec",
    "TrainingState",
    "WorkerTrainingState",
    "current_task",
    "install_multi_worker_fixes",
    "wait_for_backups",
]
