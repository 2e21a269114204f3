"""`BackupAndRestore`: a crash-safe drop-in for Keras' own callback."""

from __future__ import annotations

import datetime
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import keras

from keras_ft import compat
from keras_ft.checkpoint.lock import check_platform
from keras_ft.checkpoint.store import CheckpointWriteError
from keras_ft.distribute.cluster import TaskSpec, current_task
from keras_ft.state import NonFiniteStateError, ResumePoint, rng
from keras_ft.training import callback_state
from keras_ft.training.policy import (
    AnyOf,
    EveryEpoch,
    EveryNSeconds,
    EveryNSteps,
    KeepLast,
    Never,
    OverheadBudget,
    SaveSchedule,
)
from keras_ft.training.preemption import ClusterNotice, PreemptionWatcher, parse_signals
from keras_ft.training.resume import FastForward
from keras_ft.worker_training_state import WorkerTrainingState, validate_backup_dir


class BackupAndRestore(keras.callbacks.Callback):
    """Callback to back up and restore the training state, surviving any crash.

    A drop-in replacement for `keras.callbacks.BackupAndRestore`: it takes the
    same arguments with the same meaning. If `fit()` is interrupted (an
    exception, a killed process, a dead machine, a restarted notebook kernel),
    calling `fit()` again with this callback restores the model variables,
    the optimizer variables (including `iterations`, so learning-rate schedules
    continue) and the epoch counter from the newest backup, and training
    continues at the epoch after the last one backed up.

    Unlike Keras' own callback, every backup is committed atomically (written
    to a staging directory, fsync'ed, then renamed), carries a checksum of
    every file, and the previous `keep - 1` backups are kept until a newer one
    is committed; on restore a damaged backup is reported and the next older
    good one is used. A kill at any instant leaves a loadable backup.

    Backups live in `<backup_dir>/chief/`; files of your own in `backup_dir`
    are never deleted. The backup is deleted at the end of `fit()` only when
    every epoch ran (so not after `TerminateOnNaN`, an `EarlyStopping` stop or
    an exception), and only if `delete_checkpoint=True`. A save is skipped,
    with a warning, when the loss is NaN or infinite or a model or optimizer
    variable holds a NaN or an infinity: a non-finite state is never backed
    up.

    An epoch is backed up as soon as this callback's `on_epoch_end` runs, so
    an exception in a later callback does not lose it. If a later callback
    keeps state across epochs (`EarlyStopping`, `ReduceLROnPlateau`,
    `ModelCheckpoint`, or one with `get_state()`), a second backup taken once
    every callback's `on_epoch_end` has run replaces the first, so that their
    updates of this epoch are included.

    Example:

    ```python
    callback = keras_ft.BackupAndRestore(backup_dir="/tmp/backup")
    model.fit(x, y, epochs=10, callbacks=[callback])
    # Killed at epoch 6? Run the same script again: it resumes at epoch 7.
    ```

    Args:
        backup_dir: Path of the directory where the backup is stored. It
            should not be shared with another training run.
        save_freq: `"epoch"` to save at the end of every epoch, a positive
            integer to save every `save_freq` batches, `"auto"` to save as
            often as keeps the time saves hold up training within
            `overhead_budget` (keras-ft only), or `False` for no scheduled
            saves: only the backup taken on a preemption signal (and
            `save_every_seconds`, if set). Defaults to `"epoch"`.
        double_checkpoint: If `True`, keep at least two backups, as Keras'
            own callback does with this flag. keras-ft keeps two by default
            (`keep=2`). Defaults to `False`.
        delete_checkpoint: Whether to delete the backup once `fit()` has run
            every epoch. Defaults to `True`.
        keep: How many committed backups to keep, at least 1. Defaults to `2`.
        overhead_budget: With `save_freq="auto"`, the fraction of training
            time saves may add: the time a save holds training up, plus what
            the steps run beside its background write lose. Defaults to
            `0.02`.
        save_every_seconds: If set, also save at the first batch end after
            this many seconds since the last save (like `tf.train.Supervisor`'s
            `save_model_secs`). Defaults to `None`.
        verbose: `1` to print one line when a backup is restored, `0` for
            silence. Defaults to `1`.
        on_save_error: `"raise"` to stop training with a clear error when a
            backup cannot be written (disk full, I/O error, permission lost),
            or `"warn"` to warn and keep training, trying again at the next
            save. Either way the previous backup stays intact. Defaults to
            `"raise"`.
        preemption_signals: Signals that mean "this machine is going away":
            on one, training finishes the current batch, backs up at that
            exact step and stops. Names or numbers; `None` to leave signals
            alone. Handlers installed before are still called, and are put
            back at train end. Defaults to `("SIGTERM", "SIGINT")`.
        grace_period: Seconds allowed between the signal and the end of the
            final backup; if no batch ends in time, the process exits as the
            signal would have made it. Defaults to `25.0`.
        async_save: If `True`, a save copies the state into a host buffer
            (allocated once, at train begin) and training goes on while a
            background thread writes and commits it. The buffer is the only
            one: the next save's copy of each value waits until the previous
            save has written that value out, so memory stays bounded and no
            save is skipped. A backup counts only once committed. Write
            errors are raised at the next batch end or at train end. With
            `False`, `fit()` waits for each commit. Defaults to `True`.
        exit_on_preemption: After the final backup, end the process with exit
            status 128 + the signal's number (`SystemExit`, no traceback), so
            a job scheduler sees it was preempted. With `False`, `fit()`
            returns and `preempted_by` names the signal. Defaults to `True`.
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        *,
        keep: int = 2,
        overhead_budget: float = 0.02,
        save_every_seconds: float | None = None,
        verbose: int = 1,
        on_save_error: str = "raise",
        preemption_signals: tuple | None = ("SIGTERM", "SIGINT"),
        grace_period: float = 25.0,
        exit_on_preemption: bool = True,
        async_save: bool = True,
    ):
        super().__init__()
        check_platform()
        self.backup_dir = validate_backup_dir(backup_dir)
        if keras.backend.backend() == "tensorflow" and current_task().num_workers > 1:
            # fit() builds the model before any callback runs: fix that part
            # of Keras for multi-worker strategies now.
            compat.install_multi_worker_fixes()
        schedules = [_schedule_from_save_freq(save_freq, overhead_budget)]
        # An epoch cut short by another callback is backed up where it stopped
        # only if the user asked for saves beyond preemption ones.
        self._scheduled = save_freq is not False or save_every_seconds is not None
        if save_every_seconds is not None:
            try:
                schedules.append(EveryNSeconds(save_every_seconds))
            except ValueError:
                raise ValueError(
                    "Invalid value for argument `save_every_seconds`. Expected a "
                    "positive number of seconds or `None`. Received: "
                    f"save_every_seconds={save_every_seconds!r}"
                ) from None
        # Validate now rather than at train begin.
        KeepLast(keep)
        OverheadBudget(overhead_budget)
        if on_save_error not in ("raise", "warn"):
            raise ValueError(
                "Invalid value for argument `on_save_error`. Expected 'raise' or "
                f"'warn'. Received: on_save_error={on_save_error!r}"
            )
        if (
            isinstance(grace_period, bool)
            or not isinstance(grace_period, (int, float))
            or not grace_period > 0
        ):
            raise ValueError(
                "Invalid value for argument `grace_period`. Expected a positive "
                f"number of seconds. Received: grace_period={grace_period!r}"
            )
        self.on_save_error = on_save_error
        self.async_save = bool(async_save)
        self.exit_on_preemption = bool(exit_on_preemption)
        self.preempted_by: str | None = None
        self._watcher = PreemptionWatcher(
            parse_signals(preemption_signals), float(grace_period)
        )
        self.save_freq = save_freq
        self.save_every_seconds = save_every_seconds
        self.double_checkpoint = bool(double_checkpoint)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.keep = max(keep, 2) if double_checkpoint else keep
        self.verbose = verbose
        self._schedule = AnyOf(*schedules)
        self._state: WorkerTrainingState | None = None
        self._others: list[keras.callbacks.Callback] = []
        self._callback_order: list[keras.callbacks.Callback] = []
        self._reported_interval: int | None = None
        self._resume: ResumePoint | None = None
        self._fast_forward: FastForward | None = None
        self._pending_epoch_end: tuple[int, dict | None] | None = None
        self._epoch_begin_rng: dict = {}
        self._epoch = 0
        self._batches_in_epoch = 0
        self._skip_until = 0
        self._skip_epochs_before = 0
        self._epochs_completed = 0
        self._skipped_non_finite: str | None = None
        self._batch_ends = 0
        self._stop_at: dict | None = None
        self._notice: ClusterNotice | None = None
        self._preempted_signum: signal.Signals | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        if self._fast_forward is not None:  # Left by a fit() that raised.
            self._fast_forward.remove()
            self._fast_forward = None
        compat.probe()  # Warns once for each internal this Keras lacks.
        callback_list = compat.calling_callback_list(self)
        self._others = self._join_callback_list(callback_list)
        self._state = WorkerTrainingState(
            model, self.backup_dir, keep=self.keep, async_save=self.async_save
        )
        self._check_cluster(self._state.task)
        self._state.check_writable()
        self._state.lock()
        try:
            resume = self._state.restore()
            self._state.prepare()
        except BaseException:
            self._state.unlock()
            raise
        self._resume = resume
        self.preempted_by = None
        # Keras calls no callback when fit() raises: the handlers check that
        # this fit's CallbackList is still on the stack when a signal comes.
        self._watcher.install(training=callback_list)
        self._batch_ends, self._stop_at = 0, None
        self._notice = None
        if self._state.task.num_workers > 1:
            # A save is a collective read of the variables: a signalled worker
            # cannot save alone, so every worker stops at one agreed step.
            self._notice = ClusterNotice(self.backup_dir, resume.step if resume else 0)
            if self._state.task.is_chief:
                self._notice.clear()
        self._epochs_completed = resume.epoch if resume else 0
        self._pending_epoch_end = None
        self._skipped_non_finite = None
        # Read by fit() right after on_train_begin, and cleared again at the
        # first epoch begin so that a later fit() starts where it is told to.
        # A Keras that does not read it runs the completed epochs: they are
        # read through without training (_skip_epoch).
        jumped = compat.set_initial_epoch(model, resume.epoch if resume else None)
        self._skip_epochs_before = 0 if jumped or not resume else resume.epoch
        if jumped and resume:
            # Shuffles that follow the data adapter's count of epochs.
            compat.start_data_at_epoch(resume.epoch)
        if resume and self.verbose:
            saved = datetime.datetime.fromtimestamp(resume.saved_at)
            compat.print_msg(
                f"BackupAndRestore: restored {resume.checkpoint} (saved "
                f"{saved:%Y-%m-%d %H:%M:%S}); resuming at "
                f"{_resume_position(resume, self.params)}, optimizer step "
                f"{resume.step}."
            )
        self._schedule.start(time.monotonic())
        self._reported_interval: int | None = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        compat.set_initial_epoch(self.model, None)
        self._epoch = epoch
        self._batches_in_epoch = 0
        self._skip_until = 0
        if self._fast_forward is not None:  # Of a whole epoch skipped.
            self._fast_forward.remove()
            self._fast_forward = None
        if epoch < self._skip_epochs_before:
            self._skip_epoch()
            return
        resume, self._resume = self._resume, None
        if resume is not None:
            if self._skip_epochs_before and not resume.batch:
                # The epochs read through drew from the generators: the next
                # epoch begins with them as they were at the save.
                rng.apply(resume.extra.get("rng", {}))
            # Every other callback's on_train_begin has reset it by now (and
            # their epoch ends of epochs skipped since are undone).
            callback_state.apply(self._others, resume.extra.get("callbacks", {}))
            _warn_if_callbacks_pending(resume)
            compat.continue_tensorboard_steps(self._others, resume.step - resume.batch)
            if resume.batch and epoch == resume.epoch:
                self._continue_epoch(resume)
        # Before the data pipeline draws this epoch's shuffle, so that a resumed
        # run can replay it.
        self._epoch_begin_rng = rng.capture()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # With steps_per_execution > 1, `batch` is the last of several steps.
        steps = batch + 1 - self._batches_in_epoch
        self._batches_in_epoch = batch + 1
        self._raise_write_errors(self._state.raise_if_failed)
        self._batch_ends += 1
        signum = self._signal_to_stop_for()
        if signum is not None:
            self._stop_for_preemption(logs, signum)
            return
        if self._batches_in_epoch <= self._skip_until:
            return  # A batch trained before the restart, skipped now.
        writing = self._state.writing
        if self._schedule.on_batch_end(steps, time.monotonic(), writing):
            self._save(logs, self._epoch, self._batches_in_epoch)
            self._report_interval()

    def _signal_to_stop_for(self) -> signal.Signals | None:
        """The signal to back up and stop for at this batch end, if any."""
        watcher = self._watcher
        signalled = watcher.received is not None and not watcher.handled
        if self._notice is None:  # One process: stop at once.
            return watcher.received if signalled else None
        # Several workers: stop together at the batch end the notice names.
        if self._stop_at is None:
            if signalled:
                self._stop_at = self._notice.publish(
                    self._batch_ends + 1, watcher.received, self._state.task.task_index
                )
            else:
                self._stop_at = self._notice.read()
        if self._stop_at and self._batch_ends >= self._stop_at["batch_end"]:
            return signal.Signals[self._stop_at["signal"]]
        return None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.preempted_by or epoch < self._skip_epochs_before:
            return  # Backed up at the exact step already, or a skipped epoch.
        steps = self.params.get("steps")
        if steps and self._batches_in_epoch < steps:
            if self._scheduled and self._batches_in_epoch:
                # Stopped mid-epoch by another callback: back up where it is.
                self._save(logs, epoch, self._batches_in_epoch)
            return
        # Run, whether or not its state can be backed up: a fit() that ran
        # every epoch is over, diverged or not.
        self._epochs_completed = epoch + 1
        if not self._schedule.on_epoch_end(time.monotonic()):
            return
        # The epoch is backed up now, whatever a later callback does. Those
        # that keep state update it in their own on_epoch_end: a second
        # backup, once they have run, replaces this one (_AfterAllCallbacks).
        later = [c for c in self._later_callbacks() if _is_stateful(c)]
        if self._save(logs, epoch, None, pending=later) and later:
            self._pending_epoch_end = (epoch, logs)

    def _on_epoch_end_after_all(self, epoch: int, logs: dict | None) -> None:
        pending, self._pending_epoch_end = self._pending_epoch_end, None
        if pending is not None and pending[0] == epoch:
            self._save(pending[1], epoch, None, replaces_last=True)

    def _check_cluster(self, task: TaskSpec) -> None:
        """Refuses save schedules that workers could disagree on."""
        if task.num_workers == 1:
            return
        timed = [
            s for s in self._schedule.schedules
            if isinstance(s, (EveryNSeconds, OverheadBudget))
        ]  # fmt: skip
        if timed:
            raise ValueError(
                f"With {task.num_workers} workers, every worker must save at the "
                "same step, so saves cannot depend on each worker's clock. "
                "Use `save_freq='epoch'` or an integer number of batches "
                "instead of `save_freq='auto'` or `save_every_seconds`. "
                f"Received: save_freq={self.save_freq!r}, "
                f"save_every_seconds={self.save_every_seconds!r}"
            )

    def on_train_end(self, logs: dict | None = None) -> None:
        compat.set_initial_epoch(self.model, None)
        if self._fast_forward is not None:
            self._fast_forward.remove()
            self._fast_forward = None
        self._watcher.uninstall()
        completed = self._epochs_completed >= self.params.get("epochs", 0)
        if self._state is not None:
            if self.delete_checkpoint and completed and not self.preempted_by:
                if self._skipped_non_finite:
                    warnings.warn(
                        f"BackupAndRestore: fit() ran every epoch, but "
                        f"{self._skipped_non_finite}, so it was not backed up. "
                        "The backup of the last finite state is deleted, as "
                        "`delete_checkpoint=True` asks; pass "
                        "`delete_checkpoint=False` to keep it.",
                        stacklevel=2,
                    )
                # The backup goes: no need to finish writing the last save.
                self._raise_write_errors(self._state.discard_pending)
                self._state.delete_backup()
            else:
                self._raise_write_errors(self._state.wait)
                self._state.unlock()
        self._state = None
        if self.preempted_by and self.exit_on_preemption:
            raise SystemExit(128 + int(self._preempted_signum))

    def _stop_for_preemption(self, logs: dict | None, signum: signal.Signals) -> None:
        watcher = self._watcher
        name = signum.name
        self._preempted_signum = signum
        where = f"epoch {self._epoch + 1}, batch {self._batches_in_epoch}"
        # A batch being skipped after a restart: the backup we restored from
        # already holds this point.
        saved = f"the backup already holds {where}"
        if self._batches_in_epoch > self._skip_until:
            if self._save(logs, self._epoch, self._batches_in_epoch):
                # The process may be gone soon: this one is committed now.
                checkpoint = self._raise_write_errors(self._state.wait)
                saved = f"backed up {where}"
                if checkpoint is not None:  # None on a worker: the chief commits.
                    saved += f" to {checkpoint.path}"
            else:
                saved = f"{where} is not finite and was not backed up"
        watcher.done()
        self.preempted_by = name
        model = self.model
        model.stop_training = True
        seconds = watcher.seconds_since_signal if watcher.received else 0.0
        if watcher.received is None:  # Another worker got the signal.
            name = f"{name} (worker {self._stop_at['worker']})"
        compat.print_msg(
            f"BackupAndRestore: received {name}; {saved} {seconds:.1f} s after "
            "the signal. Stopping training; run the same script again to "
            "resume at this step."
        )
        if seconds > watcher.grace_period:
            warnings.warn(
                f"BackupAndRestore: the final backup took {seconds:.1f} s, more "
                f"than the grace period of {watcher.grace_period:g} s.",
                stacklevel=2,
            )

    def _save(
        self,
        logs: dict | None,
        epoch: int,
        batch: int | None,
        *,
        pending: Sequence[keras.callbacks.Callback] = (),
        replaces_last: bool = False,
    ) -> bool:
        """Backs up the state now; returns whether a save was started.

        `pending`: later callbacks whose epoch end has not run yet (noted
        in the backup, so that a resume from it can say so).
        """
        where = f"epoch {epoch + 1}" + (f", batch {batch}" if batch else "")
        if not _finite_loss(logs):
            self._skip_non_finite(f"the loss is {logs.get('loss')} at {where}")
            return False
        # On JAX, reading `self.model` syncs the trainer's state back into
        # the model's variables, which fit() leaves stale mid-epoch.
        self.model  # noqa: B018
        # At an epoch end, the next epoch begins with the generators as now.
        epoch_begin_rng = rng.capture() if batch is None else self._epoch_begin_rng
        extra = {
            "epoch_begin_rng": epoch_begin_rng,
            "logs": _float_logs(logs),
            "callbacks": callback_state.capture(
                _with_epoch_recorded(self._others, epoch, logs, batch)
            ),
        }
        if pending:
            extra["callbacks_pending"] = [
                key for key, c in callback_state.keyed(self._others) if c in pending
            ]
        started = time.monotonic()
        try:
            self._raise_write_errors(
                lambda: self._state.back_up(
                    epoch, batch, extra, replaces_last=replaces_last
                )
            )
        except NonFiniteStateError as e:
            shown = ", ".join(e.variables[:3])
            self._skip_non_finite(f"{shown} hold NaN or infinity at {where}")
            return False
        now = time.monotonic()
        self._schedule.saved(now, cost=now - started)
        self._skipped_non_finite = None
        return True

    def _skip_non_finite(self, what: str) -> None:
        self._skipped_non_finite = what
        warnings.warn(
            f"BackupAndRestore: {what}; not backing up a diverged model. The "
            "last good backup is kept.",
            stacklevel=3,
        )

    def _report_interval(self) -> None:
        budget = next(
            (s for s in self._schedule.schedules if isinstance(s, OverheadBudget)),
            None,
        )
        if budget is None or budget.interval is None or not self.verbose:
            return
        reported = self._reported_interval
        if reported is None or not reported / 2 <= budget.interval <= reported * 2:
            self._reported_interval = budget.interval
            compat.print_msg(
                f"BackupAndRestore: saving every {budget.interval} steps (a save "
                f"holds training up {budget.save_cost * 1000:.0f} ms, a step "
                f"takes {budget.step_time * 1000:.1f} ms; budget "
                f"{budget.budget:.1%})."
            )

    def _raise_write_errors(self, step: Any) -> Any:
        """Runs `step`; a failed write raises, or warns with `on_save_error`."""
        try:
            return step()
        except CheckpointWriteError as e:
            if self.on_save_error == "warn":
                warnings.warn(f"BackupAndRestore: {e.strerror}", stacklevel=3)
                return None
            # fit() ends here without calling on_train_end.
            self._watcher.uninstall()
            self._state.unlock()
            raise

    def _skip_epoch(self) -> None:
        """Reads through an epoch completed before the restart, not training.

        Only where this Keras' fit() does not start at the resume epoch.
        """
        steps = self.params.get("steps") or sys.maxsize
        self._skip_until = steps
        logs = self._resume.extra.get("logs", {}) if self._resume else {}
        self._fast_forward = FastForward(self.model, steps, logs, on_done=_nothing)

    def _continue_epoch(self, resume: ResumePoint) -> None:
        """Sets up the rest of an interrupted epoch to run as it would have."""
        extra = resume.extra
        if "epoch_begin_rng" in extra:
            # The data pipeline shuffles with these when iteration starts, and
            # replays every later draw as the skipped batches go through it.
            rng.apply(extra["epoch_begin_rng"])
        # So that the epoch's mean loss and metrics come out as they would
        # have; fit() reset them just before on_epoch_begin.
        metrics = extra.get("metrics", [])
        metrics_set = self._state.apply_metrics(metrics)
        self._skip_until = resume.batch
        model = self.model

        def first_batch(batch: Any) -> None:
            if metrics_set:
                return
            # TensorFlow builds compiled metrics inside the first step; build
            # them now, from the batch in hand, to give them their values.
            compat.build_metrics(model, batch)
            if not self._state.apply_metrics(metrics):
                warnings.warn(
                    f"BackupAndRestore: the backup holds {len(metrics)} metric "
                    f"variables, the model {len(model.metrics_variables)}; the "
                    "metrics of the resumed epoch start afresh.",
                    stacklevel=2,
                )

        def skipped_all() -> None:
            # The skipped batches went through the same pipeline and callbacks
            # as before and replayed their draws since the epoch began, maybe
            # on a prefetching thread that a reset now would race with. The
            # training steps did not run: their generators jump to the save.
            self._fast_forward = None
            rng.apply(extra.get("rng", {}), only=rng.MODEL_SIDE)

        self._fast_forward = FastForward(
            model,
            resume.batch,
            extra.get("logs", {}),
            on_done=skipped_all,
            on_first_batch=first_batch,
        )

    def _join_callback_list(
        self, callback_list: keras.callbacks.CallbackList | None
    ) -> list[keras.callbacks.Callback]:
        """The other callbacks of this fit(); adds our tail hook to the list."""
        if callback_list is None:
            return []
        others = [
            c
            for c in callback_list.callbacks
            if c is not self and not isinstance(c, _AfterAllCallbacks)
        ]
        # A new list, not an append: CallbackList is iterating the old one.
        callback_list.callbacks = [
            c
            for c in callback_list.callbacks
            if not (isinstance(c, _AfterAllCallbacks) and c.owner is self)
        ] + [_AfterAllCallbacks(self)]
        self._callback_order = [c for c in callback_list.callbacks]
        return others

    def _later_callbacks(self) -> list[keras.callbacks.Callback]:
        order = self._callback_order
        if self not in order:
            return []
        return [c for c in order[order.index(self) + 1 :] if c in self._others]


class _AfterAllCallbacks(keras.callbacks.Callback):
    """Runs last in the CallbackList: the point where an epoch is really over."""

    def __init__(self, owner: BackupAndRestore):
        super().__init__()
        self.owner = owner

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.owner._on_epoch_end_after_all(epoch, logs)


def _nothing() -> None:
    pass


def _is_stateful(callback: keras.callbacks.Callback) -> bool:
    # History is not: _with_epoch_recorded fills in the epoch it has not seen.
    return not isinstance(callback, keras.callbacks.History) and bool(
        callback_state.capture([callback])
    )


def _with_epoch_recorded(
    callbacks: list, epoch: int, logs: dict | None, batch: int | None
) -> list:
    """The callbacks, with a History that has not yet seen `epoch` brought up."""
    if batch is not None:
        return callbacks
    result = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.History) and epoch not in getattr(
            callback, "epoch", [epoch]
        ):
            updated = keras.callbacks.History()
            updated.epoch = [*callback.epoch, epoch]
            updated.history = {k: list(v) for k, v in callback.history.items()}
            for key, value in (logs or {}).items():
                updated.history.setdefault(key, []).append(value)
            callback = updated
        result.append(callback)
    return result


def _float_logs(logs: dict | None) -> dict[str, float]:
    result = {}
    for key, value in (logs or {}).items():
        try:
            result[key] = float(value)
        except (TypeError, ValueError):
            continue
    return result


def _schedule_from_save_freq(save_freq: Any, overhead_budget: float) -> SaveSchedule:
    if save_freq is False:
        return Never()
    if save_freq == "epoch":
        return EveryEpoch()
    if save_freq == "auto":
        return OverheadBudget(overhead_budget)
    if isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0:
        return EveryNSteps(save_freq)
    raise ValueError(
        "Invalid value for argument `save_freq`. Expected 'epoch', 'auto', a "
        "positive integer number of batches, or False (only the backup taken "
        f"on a preemption signal). Received: save_freq={save_freq!r}"
    )


def _resume_position(resume: ResumePoint, params: dict) -> str:
    """Where a resumed fit() continues, as the restore line says it."""
    epoch = f"epoch {resume.epoch + 1}/{params.get('epochs', '?')}"
    steps = params.get("steps")
    if steps and resume.batch >= steps:
        # Saved after the epoch's last batch, before its on_epoch_end ran.
        return f"the end of {epoch}"
    if resume.batch:
        return f"{epoch}, batch {resume.batch + 1}"
    return epoch


def _warn_if_callbacks_pending(resume: ResumePoint) -> None:
    pending = resume.extra.get("callbacks_pending")
    if pending:
        warnings.warn(
            f"BackupAndRestore: {resume.checkpoint} was backed up before the "
            f"on_epoch_end of {', '.join(pending)} ran (training stopped "
            "there, e.g. a later callback raised). Their state is restored as "
            f"it was before the end of epoch {resume.epoch}.",
            stacklevel=3,
        )


def _finite_loss(logs: dict | None) -> bool:
    loss = (logs or {}).get("loss")
    if loss is None:
        return True
    try:
        return math.isfinite(float(loss))
    except (TypeError, ValueError):
        return True
