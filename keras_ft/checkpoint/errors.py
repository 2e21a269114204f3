"""The errors keras-ft raises about checkpoints."""

from __future__ import annotations


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


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written; the previous ones are intact."""


class SaveCancelled(CheckpointError):
    """A save was called off before its commit; nothing was committed."""
