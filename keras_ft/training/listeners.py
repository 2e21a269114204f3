"""Checkpoint listeners: code of the user's that runs around each backup.

`tf.train.CheckpointSaverListener` for keras-ft: copy each committed
checkpoint elsewhere, log it, notify an evaluator. A listener that raises
is reported with its traceback; the checkpoint is committed and intact all
the same, and training goes on.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence

from keras_ft import events


class CheckpointListener:
    """Is told before each backup, after each commit and after a restore.

    Derive from it and override the methods you need; pass instances to
    `keras_ft.BackupAndRestore(listeners=[...])` or
    `keras_ft.WorkerTrainingState(listeners=[...])`. Only the chief (the
    process that commits) calls them. In every method, `epoch` is the number
    of epochs completed at the save (the epoch a resume starts at) and
    `step` the optimizer's `iterations`.

    `before_save()` runs in the training thread, right before the state is
    captured. `after_commit()` runs once the checkpoint is committed, in the
    background writer's thread: with `async_save=True` (the default) while
    training goes on, so keep it short or hand the work to a thread of your
    own; with `async_save=False` the save waits for it. A checkpoint that a
    later save superseded or that retention pruned may be gone by the time
    you look at `path`; copy it in `after_commit()`.
    `after_restore()` runs in the training thread after a backup has been
    loaded (at train begin, or after a `keras_ft.NanGuard` rollback).

    Example:

    ```python
    class Upload(keras_ft.CheckpointListener):
        def after_commit(self, path, epoch, step):
            shutil.copytree(path, f"/mnt/archive/{os.path.basename(path)}")
    ```
    """

    def before_save(self, epoch: int, step: int) -> None:
        """Called before the state at (`epoch`, `step`) is backed up."""

    def after_commit(self, path: str, epoch: int, step: int) -> None:
        """Called once the checkpoint at `path` is committed."""

    def after_restore(self, path: str, epoch: int, step: int) -> None:
        """Called after the checkpoint at `path` was loaded into the model."""


def check_listeners(listeners: Sequence | None) -> tuple[CheckpointListener, ...]:
    """`listeners` as a tuple, or a `ValueError` naming what is not one."""
    if listeners is None:
        return ()
    if isinstance(listeners, CheckpointListener):
        listeners = [listeners]
    if isinstance(listeners, (str, bytes)) or not hasattr(listeners, "__iter__"):
        raise ValueError(
            "Invalid value for argument `listeners`. Expected a list of "
            f"keras_ft.CheckpointListener objects. Received: listeners={listeners!r}"
        )
    listeners = tuple(listeners)
    for listener in listeners:
        if not isinstance(listener, CheckpointListener):
            raise ValueError(
                "Invalid value for argument `listeners`: every listener must be a "
                "keras_ft.CheckpointListener (derive your class from it). "
                f"Received: {listener!r} in listeners={list(listeners)!r}"
            )
    return listeners


def notify(listeners: Sequence[CheckpointListener], method: str, *args: object) -> None:
    """Calls `method(*args)` of each listener; one that raises is reported."""
    for listener in listeners:
        try:
            getattr(listener, method)(*args)
        except Exception:  # The checkpoint must not depend on user code.
            events.warn(
                "save",
                f"keras_ft: {type(listener).__name__}.{method}{args!r} raised; "
                "the backup is not affected and training goes on.\n"
                + traceback.format_exc(),
                stacklevel=2,
            )
