"""Every error and warning keras-ft raises, in one place.

Keras-free, and imports nothing of keras-ft but `threads` (a save called off
is also a `threads.Cancelled`): every layer raises from here. The public
names are also `keras_ft.<Name>`.
"""

from __future__ import annotations

from keras_ft.threads import Cancelled

# How many differences a `ConfigurationChangedError` names before "and N more".
_SHOWN = 5


class CheckpointError(Exception):
    """Base class of the errors raised by keras-ft about stored checkpoints."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint failed verification (damaged, truncated, missing)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"Checkpoint {path} is damaged: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):  # Made again from its arguments, across processes.
        return type(self), (self.path, self.reason)


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


class NonFiniteStateError(CheckpointError):
    """The state to back up holds a NaN or an infinity; nothing was saved.

    Attributes:
        variables: The weights-file paths of the values that are not finite.
        at: Where in training the state was taken ("epoch 2, batch 30"),
            when the error is raised after the save that took it returned
            (a save in the background); else `None`.
    """

    def __init__(self, variables: list[str], at: str | None = None):
        self.variables = list(variables)
        self.at = at
        shown = ", ".join(self.variables[:3])
        more = f" and {len(self.variables) - 3} more" if len(variables) > 3 else ""
        state = "this state" if at is None else f"the state at {at}"
        super().__init__(
            f"The model's variables are not finite ({shown}{more} hold NaN or "
            f"infinity), so {state} was not backed up; the previous backup "
            "is kept."
        )

    def __reduce__(self):
        return type(self), (self.variables, self.at)


class ConfigurationChangedError(ValueError):
    """The backup was written by a training configured otherwise.

    Raised with `on_config_change="raise"`, and with `"warn"` too where the
    backup's variables do not fit the model as configured now (`unfit`).

    Attributes:
        changes: What differs, one line each.
    """

    def __init__(self, directory: str, changes: list[str], unfit: str | None = None):
        self.directory, self.changes, self.unfit = directory, list(changes), unfit
        if unfit is None:
            fix = (
                "Use another `backup_dir` to start this training afresh, or "
                "`on_config_change='warn'` to continue the backup's training with "
                "this configuration."
            )
        else:
            fix = (
                f"Its variables do not fit this configuration ({unfit}), so it "
                "cannot be continued with it: use another `backup_dir` to start "
                "this training afresh, or the configuration it was written with."
            )
        super().__init__(
            f"The backup in {directory} was written by a training configured "
            f"otherwise: {summary(self.changes)}. {fix}"
        )

    def __reduce__(self):
        return type(self), (self.directory, self.changes, self.unfit)


def summary(changes: list[str]) -> str:
    """The differences a configuration check found, as one clause."""
    shown = "; ".join(changes[:_SHOWN])
    more = len(changes) - _SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


class CompatibilityWarning(UserWarning):
    """This Keras lacks an internal keras-ft uses; a public fallback is used."""
