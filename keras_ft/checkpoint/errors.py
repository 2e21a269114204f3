"""The errors keras-ft raises about checkpoints."""

from __future__ import annotations

from keras_ft.threads import Cancelled


class CheckpointError(Exception):
    """Base class of the errors raised by keras-ft about stored checkpoints."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint failed verification (damaged, truncated, missing)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"Checkpoint {path} is damaged: {reason}")
        self.path = path
        self.reason = reason


class NoGoodCheckpointError(CheckpointError):
    """Checkpoints exist, but every one of them failed verification."""


class DirectoryInUseError(RuntimeError):
    """Another live process is writing the same backup directory."""


class ProcessesDisagreeError(CheckpointError):
    """The processes of one training disagree on a save (which save it is,
    which pieces each holds, or whether each took part); nothing was
    committed."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written; the previous ones are intact."""


class LeaseLapsedError(CheckpointWriteError, DirectoryInUseError):
    """A save was refused before its commit because the writer's lease on a
    bucket went unrenewed long enough for another training to take it.

    It is a write error (`on_save_error="warn"` keeps training and tries
    again) as well as a `DirectoryInUseError`.
    """


class SaveCancelled(CheckpointError, Cancelled):
    """A save was called off before its commit; nothing was committed."""
