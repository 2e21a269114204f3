"""keras-ft: fault-tolerant Keras 3 `model.fit()`.

The public API: the callback, the class behind it for custom training loops,
what they return and raise, and a cluster process's role.
"""

from keras_ft.callback import BackupAndRestore
from keras_ft.checkpoint.lock import DirectoryInUseError
from keras_ft.checkpoint.store import (
    Checkpoint,
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NoGoodCheckpointError,
)
from keras_ft.compat import CompatibilityWarning, install_multi_worker_fixes
from keras_ft.distribute.cluster import TaskSpec, current_task
from keras_ft.state import NonFiniteStateError, ResumePoint
from keras_ft.worker_training_state import WorkerTrainingState, wait_for_backups

__version__ = "0.1.0"

__all__ = [
    "BackupAndRestore",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriteError",
    "CompatibilityWarning",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "NoGoodCheckpointError",
    "NonFiniteStateError",
    "ResumePoint",
    "TaskSpec",
    "WorkerTrainingState",
    "current_task",
    "install_multi_worker_fixes",
    "wait_for_backups",
]
