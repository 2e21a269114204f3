"""`BackupAndRestore`: a crash-safe drop-in for Keras' own callback."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import keras

from keras_ft import compat, epoch_end, goodput
from keras_ft.checkpoint.lock import check_platform
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.fit_batches import FitBatches
from keras_ft.fit_begin import close_stale, open_backup, resume_fit, watch_cluster
from keras_ft.fit_saves import FitSaves
from keras_ft.options import BackupOptions, FitOptions
from keras_ft.state import ResumePoint, rng
from keras_ft.state.training_state import optimizer_step
from keras_ft.state.weights_copy import CopyBuffer
from keras_ft.training import (
    batch_ends,
    callback_state,
    inputs,
    policy,
    resume,
    services,
    watchdog,
)
from keras_ft.training.goodput import GoodputRecorder
from keras_ft.training.listeners import CheckpointListener
from keras_ft.training.preemption import (
    Preemption,
    exit_after,
)
from keras_ft.training.services import BackupService
from keras_ft.training.validation_input import ValidationStream
from keras_ft.training.warm_start import WarmStart
from keras_ft.worker_training_state import WorkerTrainingState


class BackupAndRestore(keras.callbacks.Callback):
    """Callback to back up and restore the training state, surviving any crash.

    A drop-in replacement for `keras.callbacks.BackupAndRestore`: it takes the
    same arguments with the same meaning. If `fit()` is interrupted (an
    exception, a killed process, a dead machine, a restarted notebook kernel),
    calling `fit()` again with this callback restores the model variables,
    the optimizer variables (including `iterations`, so learning-rate schedules
    continue) and the epoch counter from the newest backup, and training
    continues at the epoch after the last one backed up.

    Unlike Keras' own callback, every backup is committed atomically with a
    checksum of every file, and older backups are kept until a newer one is
    committed: a kill at any instant leaves a loadable backup, and a damaged
    one is reported and passed over for the next older. Backups live in
    `<backup_dir>/chief/` (your own files in `backup_dir` are never deleted),
    and are deleted at the end of `fit()` only when every epoch ran (not after
    `TerminateOnNaN`, an `EarlyStopping` stop or an exception) and
    `delete_checkpoint=True`. A non-finite state (loss or variables) is never
    backed up: the save is skipped with a warning. The state of the other
    callbacks (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`, or one
    with `get_state()`), and of a `PyDataset` with `get_state()`, is backed up
    with the model's.

    Example:

    ```python
    callback = keras_ft.BackupAndRestore(backup_dir="/tmp/backup")
    model.fit(x, y, epochs=10, callbacks=[callback])
    # Killed at epoch 6? Run the same script again: it resumes at epoch 7.
    ```

    The first four arguments are those of Keras' own callback, with the same
    meaning; the keyword-only ones after them are keras-ft's.

    Args:
        backup_dir: Path of the directory where the backup is stored, or an
            fsspec URL (`s3://bucket/prefix`, `gs://...`, `memory://...`) to
            keep it in object storage. It should not be shared with another
            training run.
        save_freq: `"epoch"` to save at the end of every epoch, a positive
            integer to save every `save_freq` batches, `"auto"` to save as
            often as keeps the time saves hold up training within
            `overhead_budget` (keras-ft only), `"continuous"` to save at
            every batch end at which the last backup is committed (the
            fewest batches lost to a kill, one copy of the state per save;
            one process only; keras-ft only), or `False` for no scheduled
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
        verbose: `1` to print one line when a backup is restored (and the
            progress of uploads of 256 MB or more to object storage), `0`
            for silence. Defaults to `1`.
        on_save_error: `"raise"` to stop training with a clear error when a
            backup cannot be written (disk full, I/O error, permission lost),
            or `"warn"` to warn and keep training, trying again at the next
            save. Either way the previous backup stays intact. Defaults to
            `"raise"`.
        preemption_signals: Signals that mean "this machine is going away"
            (names or numbers): on one, training finishes the current batch,
            backs up at that exact step and stops. Handlers installed before
            are still called. `None` leaves signals alone. Defaults to
            `("SIGTERM", "SIGINT")`.
        grace_period: Seconds allowed between the signal and the end of the
            final backup; if no batch ends in time, the process exits as the
            signal would have made it. Defaults to `25.0`.
        async_save: If `True`, a save copies the state into one host buffer
            (allocated at train begin) and training goes on while a
            background thread writes and commits it; write errors are raised
            at the next batch end or at train end. With `False`, `fit()`
            waits for each commit. Defaults to `True`.
        exit_on_preemption: After the final backup, end the process with exit
            status 128 + the signal's number (`SystemExit`), so a scheduler
            sees a preemption; in a notebook an interrupt ends the cell with
            a `KeyboardInterrupt` instead. With `False`, `fit()` returns and
            `preempted_by` names the signal. Defaults to `True`.
        warm_start: Weights to start from when there is no backup: a
            `.weights.h5` or `.keras` file, another keras-ft `backup_dir`, or
            a `keras_ft.WarmStart` that picks layers. Defaults to `None`.
        listeners: `keras_ft.CheckpointListener`s told before each save,
            after each commit and after a restore. Defaults to `None`.
        storage_options: With an fsspec URL as `backup_dir`, options for its
            filesystem (credentials, `endpoint_url`, ...), as in pandas and
            fsspec. Defaults to `None`.
        on_config_change: What to do with a backup written by a training
            whose model, optimizer or loss was configured otherwise: `"warn"`
            to continue it, naming what differs, or `"raise"` to refuse it
            with `keras_ft.ConfigurationChangedError` before anything is
            loaded. Defaults to `"warn"`.
        stall_timeout: A bound on the time between two batch ends: past it,
            the process says what it was waiting for and exits with status
            75 (`keras_ft.RETRYABLE_EXIT_CODE`) for a scheduler to restart it
            from its last backup. `None`: on in a multi-process run and where
            the input loads in worker processes, with the bound max(10 x the
            slowest batch, 120 s); `"auto"`: that in any run; a number: a
            fixed bound in seconds; `False`: off. Defaults to `None`.
        first_batch_timeout: The bound for the first batch of a `fit()`
            (which compiles, and after a restore replays input), with
            `stall_timeout` on. Defaults to `1800.0`.
        manifest_key: A secret (string or bytes) for a backup others can
            write to: every manifest is signed with it (HMAC-SHA256), and a
            checkpoint unsigned or signed with another key is refused as
            damaged. Defaults to `None`: `KERAS_FT_MANIFEST_KEY` if set.
        local_dir: With a bucket as `backup_dir`, a directory on this
            machine's own disk for a fast tier: every backup is committed
            there first, then uploaded, and a restart on the same machine
            restores from it without a download when it is at least as new
            as the bucket's (docs/buckets.md). Defaults to `None`.
        local_save_freq: With `local_dir`, how often to back up to the local
            tier alone, between the bucket's saves: a positive integer number
            of batches, or `"epoch"`. Defaults to `None`: the local tier gets
            the bucket's saves only.
        snapshot: Where a save copies the state that training waits for:
            `"device"`, into new buffers on the GPU or TPU (milliseconds),
            moved to host memory beside the next steps; `"host"`, straight
            into host memory (on a GPU about a second per GB); `"auto"`, on
            the device where it has room for one more copy of the state,
            else in host memory. A model split across processes snapshots
            each process's pieces. Defaults to `"auto"`.
        goodput_file: Where to write the run's goodput record (JSON, for
            `keras-ft goodput FILE`) when `fit()` has run every epoch and
            its backup is deleted. The record is logged to the
            `keras_ft.goodput` logger then, in any case. Defaults to `None`.

    Attributes:
        backup_seconds: Seconds the saves of the current `fit()` have held
            training up (the part of each save in the training thread).
        preempted_by: The name of the signal that stopped the last `fit()`,
            or `None`.
    """

    # Keras then stops waiting for every step before the batch ends; each
    # batch's end is handled at the next batch's begin (`batch_ends.py`).
    async_safe = batch_ends.deferrable()

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int | bool = "epoch",
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
        warm_start: str | os.PathLike | WarmStart | None = None,
        listeners: Sequence[CheckpointListener] | None = None,
        storage_options: dict | None = None,
        on_config_change: str = "warn",
        manifest_key: str | bytes | None = None,
        local_dir: str | os.PathLike | None = None,
        local_save_freq: str | int | None = None,
        stall_timeout: float | str | bool | None = None,
        first_batch_timeout: float = 1800.0,
        snapshot: str = "auto",
        goodput_file: str | os.PathLike | None = None,
    ):
        super().__init__()
        check_platform()
        # Checked once, here; each fit()'s WorkerTrainingState takes it whole.
        self.options = BackupOptions(
            backup_dir,
            keep=keep,
            async_save=async_save,
            storage_options=storage_options,
            verbose=verbose,
            on_config_change=on_config_change,
            manifest_key=manifest_key,
            local_dir=local_dir,
            snapshot=snapshot,
        )
        if double_checkpoint and keep < 2:  # Keras' two files: two checkpoints.
            self.options = dataclasses.replace(self.options, keep=2)
        self.fit_options = FitOptions(
            save_freq,
            double_checkpoint,
            delete_checkpoint,
            overhead_budget=overhead_budget,
            save_every_seconds=save_every_seconds,
            on_save_error=on_save_error,
            preemption_signals=preemption_signals,
            grace_period=grace_period,
            exit_on_preemption=exit_on_preemption,
            warm_start=warm_start,
            listeners=listeners,
            local_dir=self.options.local_dir,
            local_save_freq=local_save_freq,
            stall_timeout=stall_timeout,
            first_batch_timeout=first_batch_timeout,
            goodput_file=goodput_file,
        )
        # Keras' callbacks keep their arguments as attributes of these names.
        for options in (self.fit_options, self.options):
            for field in dataclasses.fields(options):
                setattr(self, field.name, getattr(options, field.name))
        self._schedule, self._local_schedule = self.fit_options.schedules()
        self._backs_up_stopped_epochs = self.fit_options.backs_up_stopped_epochs
        self._deadline = watchdog.FitDeadline()
        self._goodput: GoodputRecorder | None = None
        # fit() builds the model before any callback runs: fix that part of
        # Keras for multi-worker strategies now.
        compat.install_multi_worker_fixes_if_needed()
        self._preemption = Preemption(
            self.fit_options.preemption_signals, self.fit_options.grace_period
        )
        self._state: WorkerTrainingState | None = None
        self._callbacks: callback_state.FitCallbacks | None = None
        self._resumption: resume.Resumption | None = None
        self._set_up_at: float | None = None  # See `set_model()`.
        self._inputs = inputs.InputPosition(None)
        self._saves: FitSaves | None = None  # The last fit()'s.
        # The buffer the last fit()'s saves copied into: the next fit() of
        # the same model reuses it (allocated and page-locked once).
        self._copy_buffer: CopyBuffer | None = None
        self._batches: FitBatches | None = None  # The last fit()'s.
        self._epochs_completed = 0
        self._services: list[BackupService] = []
        self._nothing_to_train: str | None = None
        self._later_fit: ResumePoint | None = None  # A later fit()'s backup.

    @property
    def backup_seconds(self) -> float:
        return 0.0 if self._saves is None else self._saves.backup_seconds

    @property
    def preempted_by(self) -> str | None:
        """The name of the signal that stopped the last `fit()`, or `None`."""
        return None if self._batches is None else self._batches.preempted_by

    # Keras hooks.

    def set_model(self, model: keras.Model) -> None:
        # When fit() set its callbacks up: a `TensorBoard` beside this one
        # may open its files from then on (its `set_model()` writes the
        # model's summary), before this train begin's restore.
        self._set_up_at = time.time()
        super().set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._resumption is not None:  # Left by a fit() that raised.
            self._resumption.end()
            self._resumption = None
        compat.probe()  # Warns once for each internal this Keras lacks.
        self._batches = None
        self._inputs.remove()  # Left by a fit() that raised.
        self._inputs = inputs.InputPosition(compat.fit_epoch_iterator())
        callback_list = compat.calling_callback_list(self)
        self._callbacks = callback_state.FitCallbacks(
            self, callback_list, self._on_epoch_end_after_all
        )
        close_stale(self._state)
        self._state = None
        self._state, self._goodput, point = open_backup(
            self, callback_list, self._callbacks.others, self._check_cluster
        )
        self._services = services.bind(self._callbacks.others, self)
        self._saves = FitSaves.of(self, self._state, self._inputs, self._stop_threads)
        task = self._state.task
        if task.num_workers > 1:
            # Only the chief's input state is backed up, and a Grain iterator's
            # state may differ between processes (each reads its own shard).
            self._inputs.leave_grain()
        step = point.step if point else 0
        self._preemption.start(
            callback_list, self._state.store, task.num_workers, task.is_chief, step
        )
        self._batches = FitBatches(
            lambda: self.model,
            self.params.get("steps"),
            self._state,
            self._saves,
            self._schedule,
            self._local_schedule,
            self._preemption,
            self._deadline,
            self._goodput,
            self._optimizer_step,
        )
        # A later fit()'s backup (a script's fits sharing it): this one
        # trains nothing and leaves it for that fit.
        self._later_fit = point if point and point.later_fit is not None else None
        self._epochs_completed = point.epoch if point and self._later_fit is None else 0
        self._saves.validation = ValidationStream.resuming(point)
        self._nothing_to_train = services.finished(self._callbacks.others, point)
        if point is not None:
            self._resumption = resume_fit(
                self.model,
                point,
                self.params,
                self._inputs,
                self._state.apply_metrics,
                self._nothing_to_train,
                self.warm_start,
                self.verbose,
                began=self._set_up_at,
            )
            self._resumption.hide_skipped_batches(
                callback_list, self.on_train_batch_begin, self._batches.train_batch_end
            )
        self._schedule.start(time.monotonic())
        self._local_schedule.start(time.monotonic())
        self._deadline.start(
            self.stall_timeout,
            self.first_batch_timeout,
            task,
            callback_list,
            self._batches.position,
            self._inputs.epoch_iterator,
        )
        watch_cluster(task, self._state.store, step)

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._deadline.test_begin()
        if self._resumption is not None:
            self._resumption.training_over()
        if self._batches is not None and self._saves is not None:
            self._saves.validation_begins(self.model)

    def on_test_end(self, logs: dict | None = None) -> None:
        self._deadline.test_end()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._deadline.test_batch_ended()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._deadline.epoch_begin()
        compat.set_initial_epoch(self.model, None)
        self._batches.epoch_begin(epoch)
        self._saves.epoch_begins()
        self._inputs.begin_epoch()
        if self._resumption is not None:
            self._batches.skip_until = self._resumption.begin_epoch(
                epoch, self.params.get("steps"), self._callbacks.others
            )
            if self._resumption.skips_epoch(epoch):
                return
        # Before the data pipeline draws this epoch's shuffle, so that a resumed
        # run can replay it.
        self._saves.epoch_begin_rng = rng.capture()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._resumption is not None:
            self._resumption.batch_begin()
        self._batches.train_batch_begin(batch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches.train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._resumption is not None:
            self._resumption.training_over()
        self._batches.epoch_end()
        self._deadline.epoch_end()
        skipped = self._resumption is not None and self._resumption.skips_epoch(epoch)
        if logs is not None and not (self.preempted_by or skipped):
            for service in self._services:
                service.before_epoch_backup(logs)
        end = epoch_end.EpochEnd(
            epoch=epoch,
            done=self._batches.done,
            steps=self.params.get("steps"),
            ran_out=self._inputs.ran_out(),
            preempted=bool(self.preempted_by),
            skipped=skipped,
            skip_until=self._batches.skip_until,
            stop=epoch_end.Stop.of(services.stopped_by(self._services)),
            saves_stopped_epochs=self._backs_up_stopped_epochs,
            last_saved=self._saves.last,
        )
        end = self._saves.with_schedules(end)
        decision = epoch_end.decide(end)
        if decision.completed:
            self._epochs_completed = epoch + 1
        if decision.action is not epoch_end.Action.NOTHING:
            self._saves.at_epoch_end(self.model, logs, end, decision)

    def _on_epoch_end_after_all(self, epoch: int, logs: dict | None) -> None:
        self._saves.after_every_epoch_end(self.model, epoch)

    def _optimizer_step(self) -> int:
        return optimizer_step(self.model)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._deadline.stop()
        if self._goodput is not None:
            status = "preempted" if self.preempted_by else "ended"
            self._goodput.end(self._optimizer_step(), self.backup_seconds, status)
            self._goodput = None
        compat.set_initial_epoch(self.model, None)
        if self._resumption is not None:
            self._resumption.end()
            self._resumption = None
        self._inputs.remove()
        self._preemption.stop()
        completed = self._epochs_completed >= self.params.get("epochs", 0)
        completed = completed and self._later_fit is None
        stopper = services.stopped_by(self._services)
        if stopper is not None and not stopper.backs_up_stop:
            completed = False  # Diverged (NanGuard): the last good state stays.
        services.unbind(self._services)
        self._services = []
        if self._state is not None:
            self._saves.note_history(self._later_fit)
            delete = self.delete_checkpoint and completed and not self.preempted_by
            if delete and self._state.task.is_chief:
                goodput.report_finished(self._state.store, self.goodput_file)
            self._saves.end(delete=delete)
            self._copy_buffer = self._state.copy_buffer  # Its writes are over.
        self._state = None
        if self.preempted_by and self.exit_on_preemption:
            exit_after(self._batches.signum)

    def roll_back(self) -> ResumePoint | None:
        """Loads the newest committed backup's variables, mid-`fit()`.

        For `keras_ft.NanGuard`: waits for the saves in flight, then loads
        the model's and optimizer's variables exactly as backed up.

        Returns:
            The checkpoint loaded, or `None` if nothing is backed up yet.
        """
        self.model  # noqa: B018  On JAX, syncs: the next step reads them.
        point = self._saves.run(self._state.roll_back)
        if point is not None:
            # The state is the backup's again: nothing diverged is left
            # unsaved (no warning at train end that the last state was not).
            self._saves.skipped_non_finite = None
        return point

    # What the hooks do.

    def _check_cluster(self, task: TaskSpec) -> None:
        policy.check_same_step_on_every_worker(
            self._schedule, task.num_workers, self.save_freq, self.save_every_seconds
        )

    def _stop_threads(self) -> None:
        """Before a write error ends fit() (no `on_train_end` follows)."""
        self._deadline.stop()
        self._preemption.stop()
