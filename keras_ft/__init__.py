"""keras-ft: fault-tolerant Keras 3 `model.fit()`.

The public API: the callback, the class behind it for custom training loops,
what they return and raise, a cluster process's role, the supervisor
services beside the callback, and reading a backup from another process.
Names are imported on first use, so that `keras_ft.checkpoint` (which needs
no Keras) can be used on its own without importing Keras.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "BackupAndRestore": "keras_ft.callback",
    "BackupOptions": "keras_ft.options",
    "Checkpoint": "keras_ft.checkpoint.store",
    "CheckpointError": "keras_ft.errors",
    "CheckpointListener": "keras_ft.training.listeners",
    "CheckpointWriteError": "keras_ft.errors",
    "CompatibilityWarning": "keras_ft.errors",
    "ConfigurationChangedError": "keras_ft.errors",
    "CorruptCheckpointError": "keras_ft.errors",
    "DirectoryInUseError": "keras_ft.errors",
    "NanGuard": "keras_ft.training.nan_guard",
    "NoGoodCheckpointError": "keras_ft.errors",
    "NonFiniteStateError": "keras_ft.errors",
    "RETRYABLE_EXIT_CODE": "keras_ft.training.watchdog",
    "ResumePoint": "keras_ft.state",
    "StepRate": "keras_ft.training.step_rate",
    "StopAtStep": "keras_ft.training.stops",
    "StopAtTime": "keras_ft.training.stops",
    "TaskSpec": "keras_ft.distribute.cluster",
    "WarmStart": "keras_ft.training.warm_start",
    "WorkerTrainingState": "keras_ft.worker_training_state",
    "current_task": "keras_ft.distribute.cluster",
    "initialize_cluster": "keras_ft.distribute.launch",
    "install_multi_worker_fixes": "keras_ft.compat",
    "load_checkpoint": "keras_ft.watching",
    "wait_for_backups": "keras_ft.saves.queue",
    "watch": "keras_ft.watching",
}

__all__ = [
    "BackupAndRestore",
    "BackupOptions",
    "Checkpoint",
    "CheckpointError",
    "CheckpointListener",
    "CheckpointWriteError",
    "CompatibilityWarning",
    "ConfigurationChangedError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "NanGuard",
    "NoGoodCheckpointError",
    "NonFiniteStateError",
    "RETRYABLE_EXIT_CODE",
    "ResumePoint",
    "StepRate",
    "StopAtStep",
    "StopAtTime",
    "TaskSpec",
    "WarmStart",
    "WorkerTrainingState",
    "current_task",
    "initialize_cluster",
    "install_multi_worker_fixes",
    "load_checkpoint",
    "wait_for_backups",
    "watch",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'keras_ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public API only: not this module's own imports (`importlib`, `Any`).
    return sorted({*__all__, "__version__"})


if TYPE_CHECKING:
    from keras_ft.callback import BackupAndRestore
    from keras_ft.checkpoint.store import Checkpoint
    from keras_ft.compat import install_multi_worker_fixes
    from keras_ft.distribute.cluster import TaskSpec, current_task
    from keras_ft.distribute.launch import initialize_cluster
    from keras_ft.errors import (
        CheckpointError,
        CheckpointWriteError,
        CompatibilityWarning,
        ConfigurationChangedError,
        CorruptCheckpointError,
        DirectoryInUseError,
        NoGoodCheckpointError,
        NonFiniteStateError,
    )
    from keras_ft.options import BackupOptions
    from keras_ft.saves.queue import wait_for_backups
    from keras_ft.state import ResumePoint
    from keras_ft.training.listeners import CheckpointListener
    from keras_ft.training.nan_guard import NanGuard
    from keras_ft.training.step_rate import StepRate
    from keras_ft.training.stops import StopAtStep, StopAtTime
    from keras_ft.training.warm_start import WarmStart
    from keras_ft.training.watchdog import RETRYABLE_EXIT_CODE
    from keras_ft.watching import load_checkpoint, watch
    from keras_ft.worker_training_state import WorkerTrainingState
