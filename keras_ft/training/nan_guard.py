"""`NanGuard`: on a NaN, stop with the backup kept, or roll back and go on.

`tf.train.NanTensorHook` and `keras.callbacks.TerminateOnNaN` stop; a long
training would rather go back to its last good state, maybe with a smaller
learning rate and past the batch that blew it up, and keep going.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import keras

from keras_ft import compat, events
from keras_ft.backend import device_memory, finiteness, host_memory
from keras_ft.compat import print_msg
from keras_ft.state.training_state import optimizer_step
from keras_ft.training import batch_ends
from keras_ft.training.resume import FastForward
from keras_ft.training.services import BackupService

ON_NAN = ("rollback", "stop")

# Keras' callback threads note a non-finite loss under it (module-level: a
# lock in the instance could not be deep-copied, as Keras Tuner does).
_noting = threading.Lock()


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

    Where Keras calls the batch ends off the training thread (on JAX and
    PyTorch, when every callback of the `fit()` is async-safe, as keras-ft's
    are), the guard does not make Keras wait for each step: at each batch's
    begin it launches the weights' check of the state the last batch left,
    and reads it at the next batch's begin (or the epoch's end), by when the
    device is done with it. A NaN is then found one batch later: the batch
    trained on the diverged state is undone by the rollback, and counts as
    one of `skip_batches`. A non-finite loss with finite weights (a step a
    `LossScaleOptimizer` skipped) is acted on at the epoch's end there.

    A non-finite state is never backed up: `BackupAndRestore` skips it. After
    a rollback the epoch's metrics start afresh (their means held the NaN),
    and the data go on where they were: the batches between the checkpoint
    and the NaN are not replayed. An epoch whose rollback no batch followed
    (the NaN was in its last batch) logs the metrics the backup was taken
    with, so `History` holds no NaN for it. One process only: in a cluster,
    every worker would have to roll back at the same step.

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
    # Where Keras calls the batch ends on a thread of its own, the weights
    # are checked from each batch's begin, one batch behind (class docstring).
    async_safe = batch_ends.deferrable()

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
        self._fit_model: keras.Model | None = None
        # This epoch's last rollback: the step and the logs it went back to.
        self._rolled_back: tuple[int, dict[str, float]] | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stopped = None
        self.rollbacks = []
        self._thread = threading.get_ident()
        self._fit_model = self.model  # Read at batch begins without a sync.
        # Whether a batch end ran on the training thread this fit() (Keras
        # then waits for every step's logs: each is checked there).
        self._synced = False
        self._lag_state()

    def _lag_state(self) -> None:
        # The weights' check launched at a batch begin, not yet read: the
        # flag, and the batch whose state it checks.
        self._pending: tuple[Any, int] | None = None
        # From Keras' callback thread: the last batch ended, and the first
        # one whose loss was not finite (batch, what, logs).
        self._last_end = -1
        self._lossy: tuple[int, str, dict | None] | None = None
        # Batches trained before the last rollback: their losses held the NaN
        # (the callback thread may note them after it).
        self._undone_through = -1

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._lag_state()
        self._rolled_back = None

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._synced or self.stopped is not None or not self.async_safe:
            return
        if self._read_pending(batch - 1):
            return  # Acted on it: the state is the backup's, or training stops.
        if batch > 0:
            # The weights the last batch left, checked on the device; read at
            # the next batch's begin. On JAX, from the state the step returned
            # (`self.model` would sync it into every variable, and the next
            # step gather it back).
            values = compat.live_trainable_values(self._fit_model)
            if values is None:
                values = self.model.trainable_variables
            flag = finiteness.finite_flag(values)
            if flag is not None:
                self._pending = (flag, batch - 1)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.stopped is not None:
            return
        if threading.get_ident() != self._thread:
            self._note(batch, logs)  # Keras' callback thread.
            return
        self._synced = True
        what = _non_finite(logs, self.model)  # `self.model` syncs, on JAX.
        if what is not None:
            self._act(what, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Keras has run every batch end of the epoch by now.
        if not (self._synced or self.stopped is not None or self._last_end < 0):
            self._check_epoch_end()
        if logs is not None:
            self.before_epoch_backup(logs)

    def _check_epoch_end(self) -> None:
        """The checks still owed once the batch ends ran off the training
        thread: the state the last batch left, and a loss noted not finite."""
        last = self._last_end
        if self._read_pending(last):
            return
        what = _non_finite(None, self.model)  # The epoch's last state.
        if what is not None:
            self._act(what, last, None)
        elif self._lossy is not None:
            batch, what, noted = self._lossy
            self._act(what, batch, noted, lag=last - batch)

    def before_epoch_backup(self, logs: dict) -> None:
        """Where no step followed this epoch's last rollback, its logs are
        the backup's: Keras computed them from metrics that either held the
        NaN (found at the epoch's end) or were reset with no batch since
        (found at its last batch). Changed in place, before `History` (which
        Keras puts after every callback of the `fit()`) records them, and
        before `BackupAndRestore` backs the epoch up (it calls this first)."""
        if self._rolled_back is None or self.stopped is not None:
            return
        step, saved = self._rolled_back
        if optimizer_step(self.model) != step:
            return  # Batches trained since: their metrics are the epoch's.
        for key, value in saved.items():
            # Validation ran before this epoch end: on the state rolled back
            # to where a batch end found the NaN, so only a NaN is replaced.
            if key in logs and not (
                key.startswith("val_") and finiteness.finite_number(logs[key])
            ):
                logs[key] = value

    def _note(self, batch: int, logs: dict | None) -> None:
        """A batch end on Keras' callback thread: its logs (numbers by now)
        are noted; the model is not touched here."""
        loss = _loss(logs)
        with _noting:
            self._last_end = max(self._last_end, batch)
            first = self._lossy is None or batch < self._lossy[0]
            diverged = loss is not None and not finiteness.finite_number(loss)
            if diverged and first and batch > self._undone_through:
                self._lossy = (batch, f"the loss is {loss}", logs)

    def _read_pending(self, last: int) -> bool:
        """Reads the check launched at an earlier batch begin (`last` is the
        last batch trained since); acts on a state found not finite, and
        returns whether it did."""
        if self._pending is None:
            return False
        flag, batch = self._pending
        self._pending = None
        if bool(flag):
            return False
        # Named from the state now (a NaN stays in the weights it reached;
        # a sum of finite values that overflowed finds nothing).
        what = _non_finite(None, self.model)
        if what is None:
            return False
        self._act(what, batch, None, lag=last - batch)
        return True

    def _act(self, what: str, batch: int, logs: dict | None, lag: int = 0) -> None:
        """Stops or rolls back for a non-finite `what` after `batch`; `lag`
        batches have trained since (found one batch behind)."""
        where = f"{what} at epoch {self._epoch + 1}, batch {batch + 1}"
        with _noting:  # What the callback thread noted of them is moot.
            self._undone_through = batch + lag
            self._lossy = None
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
            self._roll_back(where, logs, lag)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._lag_state()  # Nothing of the fit's state is held past it.
        self._fit_model = None
        if self._skipping is not None:
            self._skipping.remove()
            self._skipping = None

    def _give_up(self, reason: str) -> None:
        if self.backup is not None:
            reason += " The backup of the last good state is kept."
        self._stop(reason)
        events.say("stop", reason, verbose=self.verbose, write=print_msg)

    def _roll_back(self, where: str, logs: dict | None, lag: int) -> None:
        point = self.backup.roll_back()
        if point is None:
            self._give_up(f"NanGuard: {where}, and nothing is backed up yet; stopping.")
            return
        self.rollbacks.append((point.checkpoint, point.step))
        saved = point.extra.get("logs") or _finite_logs(logs)
        self._rolled_back = (point.step, saved)
        # The epoch's mean loss holds the NaN: its metrics start afresh.
        self.model.reset_metrics()
        message = (
            f"NanGuard: {where}; rolled back to {point.checkpoint} (optimizer "
            f"step {point.step}), rollback {len(self.rollbacks)} of "
            f"{self.max_rollbacks}"
        )
        if self.lr_factor is not None:
            message += self._lower_learning_rate()
        # The batches trained since the NaN are undone: already skipped.
        skip = max(0, self.skip_batches - lag)
        if self.skip_batches:
            message += f", skipping the next {self.skip_batches} batches"
        if skip:
            if self._skipping is not None:
                self._skipping.remove()
            self._skipping = FastForward(self.model, skip, saved, on_done=self._skipped)
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


def _loss(logs: dict | None) -> float | None:
    loss = (logs or {}).get("loss")
    if loss is None:
        return None
    try:
        return float(loss)
    except (TypeError, ValueError):
        return None


def _non_finite(logs: dict | None, model: keras.Model) -> str | None:
    """What is not finite (the loss, or a weight), or `None`."""
    loss = _loss(logs)
    if loss is not None and not finiteness.finite_number(loss):
        return f"the loss is {loss}"
    variables = model.trainable_variables
    on_device = bool(variables) and device_memory.accelerator(variables[0]) is not None
    # On the device: one boolean read back, not every weight copied to host
    # memory at every batch.
    if on_device and finiteness.device_all_finite(variables):
        return None
    for variable in variables:  # In host memory: read in place.
        if not finiteness.all_finite(host_memory.view(variable).reshape(-1)):
            return f"{variable.path} holds NaN or infinity"
    return None


def _finite_logs(logs: dict | None) -> dict[str, float]:
    return {
        k: v for k, v in batch_ends.numbers(logs).items() if finiteness.finite_number(v)
    }
