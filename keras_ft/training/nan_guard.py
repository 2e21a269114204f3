"""`NanGuard`: on a NaN, stop with the backup kept, or roll back and go on.

`tf.train.NanTensorHook` and `keras.callbacks.TerminateOnNaN` stop; a long
training would rather go back to its last good state, maybe with a smaller
learning rate and past the batch that blew it up, and keep going.
"""

from __future__ import annotations

import logging
import math

import keras

from keras_ft import backend, events
from keras_ft.compat import print_msg
from keras_ft.training import batch_ends
from keras_ft.training.resume import FastForward
from keras_ft.training.services import BackupService

ON_NAN = ("rollback", "stop")


class NanGuard(BackupService):
    """Acts when the loss or the weights stop being finite.

    After every batch it checks the loss and the model's trainable weights
    (one sum per variable, in place: on TensorFlow a batch of NaN inputs
    through a ReLU gives a finite loss and NaN weights). On a GPU or TPU the
    weights are checked there, in one reduction that reads back a single
    boolean; only a state found not finite is read, to name the variable.
    On a NaN or an infinity:

    - `on_nan="stop"`: training stops with a message; the backup of the
      last good state is kept (and never replaced by the diverged one), so
      a later run resumes from it.
    - `on_nan="rollback"`: the newest committed checkpoint of the
      `keras_ft.BackupAndRestore` in the same `fit()` is loaded, inside this
      `fit()`: the model's and optimizer's variables exactly as saved
      (including `iterations`). Then the learning rate is multiplied by
      `lr_factor` (once more for each rollback), the next `skip_batches`
      batches are drawn from the data but not trained on, and training goes
      on, up to `max_rollbacks` times; after that, or if nothing was backed
      up yet, it stops as with `"stop"`.

    A non-finite state is never backed up: `BackupAndRestore` skips it. After
    a rollback the epoch's metrics start afresh (their means held the NaN),
    and the data go on where they were: the batches between the checkpoint
    and the NaN are not replayed. One process only: in a cluster, every
    worker would have to roll back at the same step.

    Example:

    ```python
    model.fit(
        x, y, epochs=100,
        callbacks=[
            keras_ft.BackupAndRestore("/tmp/backup", save_freq=100),
            keras_ft.NanGuard(lr_factor=0.5, skip_batches=1),
        ],
    )
    ```

    Args:
        on_nan: `"rollback"` or `"stop"`. Defaults to `"rollback"`.
        max_rollbacks: How many rollbacks one `fit()` may do before it
            stops, a non-negative integer. Defaults to `3`.
        lr_factor: If set, a number in (0, 1] the learning rate is
            multiplied by at each rollback (an optimizer with a
            learning-rate schedule is left as it is, with a warning).
            Defaults to `None`.
        skip_batches: How many batches after the one that diverged to draw
            without training on them, a non-negative integer. Defaults to
            `0`.
        verbose: `1` to print a line at each rollback or stop, `0` for
            silence. Defaults to `1`.

    Attributes:
        rollbacks: One `(checkpoint path, optimizer step)` per rollback of
            the last `fit()`.
    """

    backs_up_stop = False  # The state it stops at is not finite.

    def __init__(
        self,
        on_nan: str = "rollback",
        max_rollbacks: int = 3,
        lr_factor: float | None = None,
        skip_batches: int = 0,
        verbose: int = 1,
    ):
        super().__init__()
        if on_nan not in ON_NAN:
            raise ValueError(
                "Invalid value for argument `on_nan`. Expected 'rollback' or "
                f"'stop'. Received: on_nan={on_nan!r}"
            )
        _check_count("max_rollbacks", max_rollbacks)
        _check_count("skip_batches", skip_batches)
        if lr_factor is not None and (
            isinstance(lr_factor, bool)
            or not isinstance(lr_factor, (int, float))
            or not 0 < lr_factor <= 1
        ):
            raise ValueError(
                "Invalid value for argument `lr_factor`. Expected `None` or a "
                f"number in (0, 1]. Received: lr_factor={lr_factor!r}"
            )
        self.on_nan = on_nan
        self.max_rollbacks = max_rollbacks
        self.lr_factor = lr_factor
        self.skip_batches = skip_batches
        self.verbose = verbose
        self.rollbacks: list[tuple[str, int]] = []
        self._epoch = 0
        self._skipping: FastForward | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stopped = None
        self.rollbacks = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.stopped is not None:
            return
        what = _non_finite(logs, self.model)  # `self.model` syncs, on JAX.
        if what is None:
            return
        where = f"{what} at epoch {self._epoch + 1}, batch {batch + 1}"
        if self.on_nan == "stop":
            self._give_up(f"NanGuard: {where}; stopping.")
        elif len(self.rollbacks) >= self.max_rollbacks:
            self._give_up(
                f"NanGuard: {where}, after {len(self.rollbacks)} rollbacks "
                f"(max_rollbacks={self.max_rollbacks}); stopping."
            )
        elif self.backup is None:
            self._give_up(
                f"NanGuard: {where}, and there is no keras_ft.BackupAndRestore "
                "in this fit() to roll back to; stopping."
            )
        else:
            self._roll_back(where, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._skipping is not None:
            self._skipping.remove()
            self._skipping = None

    def _give_up(self, reason: str) -> None:
        if self.backup is not None:
            reason += " The backup of the last good state is kept."
        self._stop(reason)
        events.say("stop", reason, verbose=self.verbose, write=print_msg)

    def _roll_back(self, where: str, logs: dict | None) -> None:
        point = self.backup.roll_back()
        if point is None:
            self._give_up(f"NanGuard: {where}, and nothing is backed up yet; stopping.")
            return
        self.rollbacks.append((point.checkpoint, point.step))
        # The epoch's mean loss holds the NaN: its metrics start afresh.
        self.model.reset_metrics()
        message = (
            f"NanGuard: {where}; rolled back to {point.checkpoint} (optimizer "
            f"step {point.step}), rollback {len(self.rollbacks)} of "
            f"{self.max_rollbacks}"
        )
        if self.lr_factor is not None:
            message += self._lower_learning_rate()
        if self.skip_batches:
            message += f", skipping the next {self.skip_batches} batches"
            if self._skipping is not None:
                self._skipping.remove()
            self._skipping = FastForward(
                self.model,
                self.skip_batches,
                point.extra.get("logs") or _finite_logs(logs),
                on_done=self._skipped,
            )
        events.say(
            "stop",
            message + ".",
            verbose=self.verbose,
            level=logging.WARNING,
            write=print_msg,
        )

    def _skipped(self) -> None:
        self._skipping = None

    def _lower_learning_rate(self) -> str:
        optimizer = self.model.optimizer
        factor = self.lr_factor ** len(self.rollbacks)
        try:
            # The rollback restored the saved rate (an optimizer variable).
            rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            optimizer.learning_rate = rate * factor
        except TypeError:  # A LearningRateSchedule: not ours to change.
            events.warn(
                "stop",
                "NanGuard: the optimizer's learning rate is a schedule; "
                "`lr_factor` is not applied.",
                stacklevel=3,
            )
            return ""
        return f", learning rate {rate:.3g} -> {rate * factor:.3g}"


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a non-negative "
            f"integer. Received: {name}={value!r}"
        )


def _non_finite(logs: dict | None, model: keras.Model) -> str | None:
    """What is not finite (the loss, or a weight), or `None`."""
    loss = (logs or {}).get("loss")
    if loss is not None:
        try:
            value = float(loss)
        except (TypeError, ValueError):
            value = 0.0
        if not math.isfinite(value):
            return f"the loss is {value}"
    variables = model.trainable_variables
    on_device = bool(variables) and backend.accelerator(variables[0]) is not None
    # On the device: one boolean read back, not every weight copied to host
    # memory at every batch.
    if on_device and backend.device_all_finite(variables):
        return None
    for variable in variables:  # In host memory: read in place.
        if not backend.all_finite(backend.view(variable).reshape(-1)):
            return f"{variable.path} holds NaN or infinity"
    return None


def _finite_logs(logs: dict | None) -> dict[str, float]:
    return {k: v for k, v in batch_ends.numbers(logs).items() if math.isfinite(v)}
