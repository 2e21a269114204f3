"""keras-ft: fault-tolerant Keras 3 `model.fit()`.

The public API: the callback, the class behind it for custom training loops,
what they return and raise, and a cluster process's role. Names are imported
on first use, so that `keras_ft.checkpoint` (which needs no Keras) can be
used on its own without importing Keras.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "BackupAndRestore": "keras_ft.callback",
    "Checkpoint": "keras_ft.checkpoint.store",
    "CheckpointError": "keras_ft.checkpoint.errors",
    "CheckpointWriteError": "keras_ft.checkpoint.errors",
    "CompatibilityWarning": "keras_ft.compat",
    "CorruptCheckpointError": "keras_ft.checkpoint.errors",
    "DirectoryInUseError": "keras_ft.checkpoint.lock",
    "NoGoodCheckpointError": "keras_ft.checkpoint.errors",
    "NonFiniteStateError": "keras_ft.state",
    "ResumePoint": "keras_ft.state",
    "TaskSpec": "keras_ft.distribute.cluster",
    "WorkerTrainingState": "keras_ft.worker_training_state",
    "current_task": "keras_ft.distribute.cluster",
    "install_multi_worker_fixes": "keras_ft.compat",
    "wait_for_backups": "keras_ft.worker_training_state",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'keras_ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from keras_ft.callback import BackupAndRestore
    from keras_ft.checkpoint.errors import (
        CheckpointError,
        CheckpointWriteError,
        CorruptCheckpointError,
        NoGoodCheckpointError,
    )
    from keras_ft.checkpoint.lock import DirectoryInUseError
    from keras_ft.checkpoint.store import Checkpoint
    from keras_ft.compat import CompatibilityWarning, install_multi_worker_fixes
    from keras_ft.distribute.cluster import TaskSpec, current_task
    from keras_ft.state import NonFiniteStateError, ResumePoint
    from keras_ft.worker_training_state import WorkerTrainingState, wait_for_backups
