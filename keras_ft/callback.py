"""`BackupAndRestore`: a crash-safe drop-in for Keras' own callback."""

from __future__ import annotations

import datetime
import math
import os
import time
import warnings
from typing import Any

import keras
from keras.src.utils import io_utils

from keras_ft.policy import AnyOf, EveryEpoch, EveryNSeconds, EveryNSteps, KeepLast
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
    with a warning, when the loss is NaN or infinite.

    Example:

    ```python
    callback = keras_ft.BackupAndRestore(backup_dir="/tmp/backup")
    model.fit(x, y, epochs=10, callbacks=[callback])
    # Killed at epoch 6? Run the same script again: it resumes at epoch 7.
    ```

    Args:
        backup_dir: Path of the directory where the backup is stored. It
            should not be shared with another training run.
        save_freq: `"epoch"` to save at the end of every epoch, or a positive
            integer to save every `save_freq` batches. Defaults to `"epoch"`.
        double_checkpoint: If `True`, keep at least two backups, as Keras'
            own callback does with this flag. keras-ft keeps two by default
            (`keep=2`). Defaults to `False`.
        delete_checkpoint: Whether to delete the backup once `fit()` has run
            every epoch. Defaults to `True`.
        keep: How many committed backups to keep, at least 1. Defaults to `2`.
        save_every_seconds: If set, also save at the first batch end after
            this many seconds since the last save (like `tf.train.Supervisor`'s
            `save_model_secs`). Defaults to `None`.
        verbose: `1` to print one line when a backup is restored, `0` for
            silence. Defaults to `1`.
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        *,
        keep: int = 2,
        save_every_seconds: float | None = None,
        verbose: int = 1,
    ):
        super().__init__()
        self.backup_dir = validate_backup_dir(backup_dir)
        schedules = [_schedule_from_save_freq(save_freq)]
        if save_every_seconds is not None:
            try:
                schedules.append(EveryNSeconds(save_every_seconds))
            except ValueError:
                raise ValueError(
                    "Invalid value for argument `save_every_seconds`. Expected a "
                    "positive number of seconds or `None`. Received: "
                    f"save_every_seconds={save_every_seconds!r}"
                ) from None
        KeepLast(keep)  # Validates `keep` now rather than at train begin.
        self.save_freq = save_freq
        self.save_every_seconds = save_every_seconds
        self.double_checkpoint = bool(double_checkpoint)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.keep = max(keep, 2) if double_checkpoint else keep
        self.verbose = verbose
        self._schedule = AnyOf(*schedules)
        self._state: WorkerTrainingState | None = None
        self._epoch = 0
        self._batches_in_epoch = 0
        self._epochs_completed = 0
        self._epoch_cut_short = False
        self._warned_non_finite = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        self._state = WorkerTrainingState(model, self.backup_dir, keep=self.keep)
        self._state.check_writable()
        resume = self._state.restore()
        self._epochs_completed = resume.epoch if resume else 0
        # Read by fit() right after on_train_begin, and cleared again at the
        # first epoch begin so that a later fit() starts where it is told to.
        model._initial_epoch = resume.epoch if resume else None
        if resume and self.verbose:
            saved = datetime.datetime.fromtimestamp(resume.saved_at)
            epochs = self.params.get("epochs", "?")
            io_utils.print_msg(
                f"BackupAndRestore: restored {resume.checkpoint} (saved "
                f"{saved:%Y-%m-%d %H:%M:%S}); resuming at epoch "
                f"{resume.epoch + 1}/{epochs}, optimizer step {resume.step}."
            )
        self._schedule.start(time.monotonic())
        self._warned_non_finite = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.model._initial_epoch = None
        self._epoch = epoch
        self._batches_in_epoch = 0
        self._epoch_cut_short = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # With steps_per_execution > 1, `batch` is the last of several steps.
        steps = batch + 1 - self._batches_in_epoch
        self._batches_in_epoch = batch + 1
        if self._schedule.on_batch_end(steps, time.monotonic()):
            self._save(logs, self._epoch, self._batches_in_epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        steps = self.params.get("steps")
        self._epoch_cut_short = (
            not _finite_loss(logs) or bool(steps) and self._batches_in_epoch < steps
        )
        if self._epoch_cut_short:
            if _finite_loss(logs) and self._batches_in_epoch:
                # Stopped mid-epoch by another callback: back up where it is.
                self._save(logs, epoch, self._batches_in_epoch)
            return
        self._epochs_completed = epoch + 1
        if self._schedule.on_epoch_end(time.monotonic()):
            self._save(logs, epoch, None)

    def on_train_end(self, logs: dict | None = None) -> None:
        model = self.model
        model._initial_epoch = None
        completed = self._epochs_completed >= self.params.get("epochs", 0)
        if self.delete_checkpoint and completed and self._state is not None:
            self._state.delete_backup()
        self._state = None

    def _save(self, logs: dict | None, epoch: int, batch: int | None) -> None:
        if not _finite_loss(logs):
            if not self._warned_non_finite:
                warnings.warn(
                    f"BackupAndRestore: loss is {logs.get('loss')} at epoch "
                    f"{epoch + 1}; not backing up a diverged model. The last "
                    "good backup is kept.",
                    stacklevel=2,
                )
                self._warned_non_finite = True
            return
        # On JAX, reading `self.model` syncs the trainer's state back into
        # the model's variables, which fit() leaves stale mid-epoch.
        self.model  # noqa: B018
        self._state.back_up(epoch, batch)
        self._schedule.saved(time.monotonic())


def _schedule_from_save_freq(save_freq: Any) -> EveryEpoch | EveryNSteps:
    if save_freq == "epoch":
        return EveryEpoch()
    if isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0:
        return EveryNSteps(save_freq)
    raise ValueError(
        "Invalid value for argument `save_freq`. Expected either 'epoch' or a "
        f"positive integer number of batches. Received: save_freq={save_freq!r}"
    )


def _finite_loss(logs: dict | None) -> bool:
    loss = (logs or {}).get("loss")
    if loss is None:
        return True
    try:
        return math.isfinite(float(loss))
    except (TypeError, ValueError):
        return True
