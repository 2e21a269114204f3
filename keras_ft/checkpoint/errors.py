"""The errors keras-ft raises about checkpoints (defined in `keras_ft.errors`,
where every error of keras-ft is; named here too, where they have always
been importable from)."""

from __future__ import annotations

from keras_ft.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DirectoryInUseError,
    LeaseLapsedError,
    NoGoodCheckpointError,
    ProcessesDisagreeError,
    SaveCancelled,
)

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "LeaseLapsedError",
    "NoGoodCheckpointError",
    "ProcessesDisagreeError",
    "SaveCancelled",
]
