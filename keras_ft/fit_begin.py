"""What `BackupAndRestore` does at train begin: opens the fit()'s backup,
locks it and restores from it (or warm starts a model with no backup), and
sets fit() to resume where the backup was."""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable
from typing import Any

import keras

from keras_ft import compat, events, holdings
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.distribute.launch import (
    launch_from_environment,
    warn_of_jax_default_timeouts,
)
from keras_ft.errors import CheckpointWriteError
from keras_ft.state import ResumePoint
from keras_ft.training import exits, inputs, restarts, resume, tuner
from keras_ft.training.goodput import GoodputRecorder
from keras_ft.training.preemption import interactive
from keras_ft.worker_training_state import WorkerTrainingState


def fit_number(backup_dir: str) -> int:
    """The number of the fit() now opening `backup_dir` in this process
    (1 for the first), counting those before it: a script's fits sharing one
    are told apart by number. Not in a notebook, whose cells run again in
    any order: there, a fit() resumes the newest backup, whichever cell
    wrote it."""
    fits = holdings.get("fits", backup_dir) or []
    holdings.put("fits", backup_dir, [*fits, {}])
    return len(fits) + 1


def histories_before(backup_dir: str, number: int | None) -> list[dict]:
    """The `History` state of each fit() before fit() #`number` on
    `backup_dir` in this process (`{}` for one that did not end): a later
    fit's backup holds them, for a rerun's earlier fits to return."""
    return list((holdings.get("fits", backup_dir) or [])[: (number or 1) - 1])


def record_history(backup_dir: str, number: int | None, history: dict) -> None:
    """Notes fit() #`number`'s `History` state as it ends."""
    fits = holdings.get("fits", backup_dir) or []
    if number is not None and 0 < number <= len(fits):
        fits[number - 1] = history


def close_stale(stale: WorkerTrainingState | None) -> None:
    """Closes the state a `fit()` that raised left (Keras calls no
    `on_train_end` then): its writes are committed, its lock goes, and the
    process's thread pools close once no training holds them."""
    if stale is None:
        return
    try:
        stale.close()
    except CheckpointWriteError as e:
        events.warn("save", f"BackupAndRestore: a backup of the last fit() failed: {e}")


def watch_cluster(task: TaskSpec, store: CheckpointStore, step: int) -> None:
    """A lost peer ends this process retryably; a launcher's restarts that
    make no progress are said."""
    if task.num_workers > 1:
        exits.exit_retryably_on_lost_peer()
        warn_of_jax_default_timeouts(task.num_workers)
    launch = launch_from_environment()
    if launch is not None and task.is_chief:
        restarts.check_progress(store, launch.restart, step)


def open_backup(
    callback: Any,
    callback_list: Any,
    others: list[keras.callbacks.Callback],
    check_task: Callable[[TaskSpec], None],
) -> tuple[WorkerTrainingState, GoodputRecorder | None, ResumePoint | None]:
    """Opens `callback`'s backup (a `BackupAndRestore`'s arguments) for
    the fit() calling `callback_list`, locks it and restores from it, or
    warm starts the model when there is no backup.

    Returns:
        The training's state (locked), its goodput record (on the chief),
        and where training resumes (`None`: from the start).
    """
    model = callback.model
    # Inside a Keras Tuner search, the trial's own directory.
    backup_dir = tuner.trial_backup_dir(
        callback.backup_dir, callback_list.callbacks if callback_list else []
    )
    options = callback.options
    if backup_dir != options.backup_dir:
        options = dataclasses.replace(options, backup_dir=backup_dir)
    state = WorkerTrainingState(
        model,
        options,
        listeners=callback.listeners,
        check_extra=functools.partial(resume.check_saved, callbacks=others),
    )
    state.fit_number = None if interactive() else fit_number(backup_dir)
    warmed = None
    try:
        check_task(state.task)
        state.check_writable()
        with state.locked():  # Released if the restore fails.
            goodput = GoodputRecorder(state.store) if state.task.is_chief else None
            if goodput is not None:
                goodput.restore_begin()
            point = state.restore()
            if goodput is not None:
                goodput.restore_end(point.step if point else 0)
            if point is None and callback.warm_start is not None:
                warmed = callback.warm_start.apply(model)
            # The last fit()'s copy buffer, if this model's file is the same;
            # none made where only a preemption would save.
            state.prepare(
                copies=callback._backs_up_stopped_epochs,
                reuse=callback._copy_buffer,
            )
    except BaseException:
        state.unlock()  # Nothing is being written yet.
        raise
    if warmed:
        events.say(
            "restore",
            f"BackupAndRestore: no backup to resume from; {warmed}.",
            verbose=callback.verbose,
            write=compat.print_msg,
        )
    return state, goodput, point


def resume_fit(
    model: keras.Model,
    point: ResumePoint,
    params: dict,
    position: inputs.InputPosition,
    apply_metrics: Callable[[list], bool],
    nothing_to_train: str | None,
    warm_start: Any,
    verbose: int,
    began: float | None = None,
) -> resume.Resumption:
    """Sets fit() to go on from `point` (or to train nothing, where
    `nothing_to_train` says why), says so, and returns what carries the
    resume through the first epoch."""
    epochs = params.get("epochs", 0)
    start = point
    if point.later_fit is not None:
        # This fit() ran to its end before: the state is the later one's.
        nothing_to_train = (
            f"it was written by fit() #{point.later_fit} of this script, which "
            "runs after this one: nothing was loaded, and that fit() resumes it"
        )
        start = dataclasses.replace(point, epoch=epochs, batch=0)
    elif nothing_to_train and point.epoch < epochs:
        # A stop condition is met already: fit() runs no epoch.
        start = dataclasses.replace(point, epoch=epochs, batch=0)
    # Read by fit() right after on_train_begin, and cleared again at the
    # first epoch begin so that a later fit() starts where it is told to.
    # A Keras that does not read it runs the completed epochs: they are
    # read through without training.
    jumped = compat.set_initial_epoch(model, start.epoch)
    if jumped and start is point:  # Shuffles follow the adapter's epoch.
        compat.start_data_at_epoch(position.epoch_iterator, point.epoch)
    if not jumped and start is not point:
        model.stop_training = True  # After the first batch, read through.
    if start is point:
        _warn_if_epoch_changed(point, params.get("steps"))
    resumption = resume.Resumption(
        model, start, apply_metrics, jumped, position, began=began
    )
    saved = datetime.datetime.fromtimestamp(point.saved_at)
    where = f"resuming at {resume.position(point, params)}, optimizer step {point.step}"
    if nothing_to_train:
        where = f"{nothing_to_train}: fit() ends without training"
    verb = "kept" if point.later_fit is not None else "restored"
    message = (
        f"BackupAndRestore: {verb} {point.checkpoint} (saved "
        f"{saved:%Y-%m-%d %H:%M:%S}); {where}"
    )
    if warm_start is not None:
        message += f"; warm start from {warm_start.path} not applied"
    events.say("restore", message + ".", verbose=verbose, write=compat.print_msg)
    return resumption


def _warn_if_epoch_changed(point: ResumePoint, steps: int | None) -> None:
    """Warns where a mid-epoch backup counted its epoch's batches otherwise
    than this fit() does (another `batch_size` or `steps_per_epoch`, more or
    fewer samples): its position may name other batches."""
    saved = point.extra.get("epoch_batches")
    if not point.batch or not saved or not steps or saved == steps:
        return
    events.warn(
        "restore",
        f"BackupAndRestore: {point.checkpoint} was saved after batch "
        f"{point.batch} of {saved} of epoch {point.epoch + 1}, but an epoch of "
        f"this fit() has {steps} (another `batch_size`, `steps_per_epoch` or "
        f"data). It resumes after batch {min(point.batch, steps)} of {steps}: "
        "where the batches differ, some samples of that epoch train twice or "
        "not at all. For an exact resume, rerun with the `batch_size`, "
        "`steps_per_epoch` and data of the backed-up run.",
        stacklevel=4,
    )
