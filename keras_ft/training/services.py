"""What the supervisor services have in common: a link to the backup.

`fit()` gives a callback no handle on the others. `BackupAndRestore` hands
itself to every `BackupService` among them at train begin (and takes itself
back at train end), so that a stop condition can have the exact step backed
up, a NaN guard can roll back to the newest committed checkpoint, and a step
rate can report the time saves cost. Without a `BackupAndRestore` in the
same `fit()`, a service still works as far as it can alone, and says so.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_ft.training import callback_state


class BackupService(keras.callbacks.Callback):
    """A callback that works with the `BackupAndRestore` of the same `fit()`.

    Attributes:
        backup: That `keras_ft.BackupAndRestore`, between its
            `on_train_begin` and `on_train_end`; otherwise `None`.
        stopped: Why this service stopped training in the current `fit()`,
            or `None`. `BackupAndRestore` keeps its backup when a service
            stopped training, and, if `backs_up_stop` is set, backs up the
            step where it stopped.
    """

    # Whether the step where this service stops training is backed up.
    backs_up_stop = True

    def __init__(self) -> None:
        super().__init__()
        self.backup: Any = None
        self.stopped: str | None = None

    def _stop(self, reason: str, model: keras.Model | None = None) -> None:
        """Stops training after this batch, saying why. Off the training
        thread, pass the `model` read on it: on JAX, reading `self.model`
        syncs the trainer's state into the variables."""
        self.stopped = reason
        (model if model is not None else self.model).stop_training = True

    def before_epoch_backup(self, logs: dict) -> None:
        """Called by `BackupAndRestore` at an epoch's end, before it backs
        the epoch up, whatever the order of the callbacks: this service may
        correct the epoch's `logs` in place first."""

    def finished(self, step: int, saved_state: dict | None) -> str | None:
        """Why a run restored at optimizer step `step` must not train at all.

        `saved_state` is this callback's `get_state()` as it was backed up,
        if it has one. Returns `None` if training may go on.
        """
        return None


def bind(callbacks: list[keras.callbacks.Callback], backup: Any) -> list[BackupService]:
    """Hands `backup` to every `BackupService` among `callbacks`; returns
    those services."""
    found = [c for c in callbacks if isinstance(c, BackupService)]
    for service in found:
        service.backup = backup
    return found


def unbind(found: list[BackupService]) -> None:
    """Takes the backup back from the services `found` (at train end)."""
    for service in found:
        service.backup = None


def finished(callbacks: list[keras.callbacks.Callback], point: Any) -> str | None:
    """Why the run restored at `point` (a `ResumePoint`, or `None`) has
    nothing left to train, as one of `callbacks` says, or `None`."""
    if point is None:
        return None
    states = point.extra.get("callbacks", {})
    for key, callback in callback_state.keyed(callbacks):
        if isinstance(callback, BackupService):
            reason = callback.finished(point.step, states.get(key))
            if reason:
                return reason
    return None


def stopped_by(found: list[BackupService]) -> BackupService | None:
    """The first of the services `found` that stopped training, or `None`."""
    for service in found:
        if service.stopped is not None:
            return service
    return None
