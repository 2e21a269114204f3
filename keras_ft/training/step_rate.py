"""`StepRate`: training speed, and what backups cost it, in the logs."""

from __future__ import annotations

import threading
import time

from keras_ft.training.services import BackupService


class StepRate(BackupService):
    """Adds `steps_per_second` and `backup_seconds` to the logs.

    `tf.train.Supervisor`'s `global_step/sec` for `fit()`. At each batch end
    and epoch end it writes into the logs that the callbacks after it see
    (so put it before `keras.callbacks.TensorBoard` or `CSVLogger` in the
    list; `History` always comes last):

    - `steps_per_second`: optimizer steps per second of wall time, since the
      previous batch end (batch logs) or over the epoch (epoch logs);
    - `backup_seconds`: the seconds saves of the `keras_ft.BackupAndRestore`
      in the same `fit()` held training up over the same span (the copy in
      the training thread; a background write does not count). A save at a
      batch end counts at that batch if `BackupAndRestore` comes before
      `StepRate` in the list, at the next one otherwise; the backup at an
      epoch end counts in the next epoch's logs unless it comes first.

    It is async-safe: on JAX and PyTorch, where no other callback needs
    each step's logs at once, Keras calls its batch ends on a thread of its
    own without waiting for every step, and a batch's rate is measured when
    its logs are ready (its step done on the device). Keras' pool may call
    them out of order; one that arrives after a later batch's adds nothing
    to the logs. `BackupAndRestore` then saves at the next batch's begin,
    so a save's time counts at a later batch.

    TensorBoard writes batch logs on its step axis, which keras-ft continues
    across restarts; epoch logs on the epoch axis.

    Example:

    ```python
    model.fit(
        x, y, epochs=10,
        callbacks=[
            keras_ft.BackupAndRestore("/tmp/backup", save_freq=100),
            keras_ft.StepRate(),
            keras.callbacks.CSVLogger("/tmp/log.csv"),
        ],
    )
    ```
    """

    # Keras calls the batch ends off the training thread where every callback
    # allows it (JAX, PyTorch): nothing here touches the model.
    async_safe = True

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._batch_time = self._epoch_time = 0.0
        self._batch_step = self._epoch_step = 0
        self._batch_backup = self._epoch_backup = 0.0
        self._steps = 0  # Batches this fit() has trained or skipped.
        self._epoch_start_batch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        now = time.monotonic()
        self._steps = 0
        self._batch_time = self._epoch_time = now
        self._batch_step = self._epoch_step = 0
        self._batch_backup = self._epoch_backup = self._backup_seconds()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_start_batch = 0

    def __deepcopy__(self, memo: dict) -> StepRate:
        # Keras Tuner deep-copies the callbacks for each trial; a lock cannot
        # be copied, and the counts start again at train begin.
        return type(self)()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # With steps_per_execution > 1, `batch` is the last of several.
        with self._lock:
            if batch + 1 <= self._epoch_start_batch:
                return  # Keras' pool called it after a later batch's.
            self._steps += batch + 1 - self._epoch_start_batch
            self._epoch_start_batch = batch + 1
            if logs is None:
                return
            now, backup = time.monotonic(), self._backup_seconds()
            logs["steps_per_second"] = _rate(
                self._steps - self._batch_step, now - self._batch_time
            )
            logs["backup_seconds"] = backup - self._batch_backup
            self._batch_time, self._batch_step, self._batch_backup = (
                now,
                self._steps,
                backup,
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        now, backup = time.monotonic(), self._backup_seconds()
        if logs is not None:
            logs["steps_per_second"] = _rate(
                self._steps - self._epoch_step, now - self._epoch_time
            )
            logs["backup_seconds"] = backup - self._epoch_backup
        self._epoch_time, self._epoch_step, self._epoch_backup = (
            now,
            self._steps,
            backup,
        )

    def _backup_seconds(self) -> float:
        return 0.0 if self.backup is None else self.backup.backup_seconds


def _rate(steps: int, seconds: float) -> float:
    return steps / seconds if seconds > 0 else 0.0
