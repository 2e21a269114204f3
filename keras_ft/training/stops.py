"""Stop conditions: at an optimizer step, or after a wall-clock budget.

`tf.train.StopAtStepHook` and TensorLayer's `StopAtTimeHook` for `fit()`.
Where one stops training, the `BackupAndRestore` of the same `fit()` backs
up that exact step first, so a later run continues from it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import keras

from keras_ft import compat, events
from keras_ft.compat import print_msg
from keras_ft.state.training_state import optimizer_step
from keras_ft.training.policy import check_seconds
from keras_ft.training.resume import skipping
from keras_ft.training.services import BackupService

# One stop at a time: batch ends on Keras' callback threads may race to it.
_stopping = threading.Lock()


class StopAtStep(BackupService):
    """Stops training when the optimizer has taken `last_step` steps.

    The step is the optimizer's `iterations`, which a `BackupAndRestore`
    restores, so the count goes on across restarts: a resumed run stops at
    the same step, and a run resumed from a backup already at `last_step`
    ends at once without training. Training stops at the first batch end
    at or past `last_step` (with `steps_per_execution > 1`, at the end of
    the execution that reaches it), and `BackupAndRestore` backs up that
    step.

    It counts the steps at each batch's begin, and reads the optimizer's
    step (which waits for the steps queued on the device) only at the start
    of a `fit()`, after its first step, and where the count says the batch
    about to run may reach `last_step`; that batch's step is followed by one
    more read (a step a `LossScaleOptimizer` skips on overflow does not
    count), and the stop comes after it if it did reach `last_step`. It has
    no batch end of its own, so Keras need not wait for every step on its
    account.

    Example:

    ```python
    model.fit(
        x, y, epochs=100,
        callbacks=[
            keras_ft.BackupAndRestore("/tmp/backup"),
            keras_ft.StopAtStep(10_000),
        ],
    )
    ```

    Args:
        last_step: The optimizer step to stop at, a positive integer.
        verbose: `1` to print one line when training stops, `0` for silence.
            Defaults to `1`.
    """

    def __init__(self, last_step: int, verbose: int = 1):
        super().__init__()
        if (
            isinstance(last_step, bool)
            or not isinstance(last_step, int)
            or last_step < 1
        ):
            raise ValueError(
                "Invalid value for argument `last_step`. Expected a positive "
                f"integer (an optimizer step). Received: last_step={last_step!r}"
            )
        self.last_step = last_step
        self.verbose = verbose
        self._fit_model: keras.Model | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stopped = None
        # Its train function and steps per execution, read at every batch
        # begin without `self.model`'s sync of JAX's state (at each batch).
        self._fit_model = self.model
        _put_back(self._fit_model)  # Left by a fit() that raised.
        # The optimizer's step when last read, the steps counted since, and
        # the most it was seen to advance per training step (1 for Keras'
        # own train step; a custom one may apply the optimizer twice).
        self._read: int | None = None
        self._since = 0
        self._per_step = 1
        self._learned = False

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.stopped is not None:
            return
        ahead = self._steps_ahead(batch)
        # Read at the start and once after the first step trained (how far a
        # step takes the optimizer); where the batch may reach the end, the
        # step is read right after it (`_look_after_step`), not before too.
        learn = not self._learned and self._since > 0
        if self._read is None or learn:
            # On JAX, `self.model` syncs the trainer's state into the variables.
            step = optimizer_step(self.model)
            if self._since > 0:
                self._learned = True
                per_step = math.ceil((step - self._read) / self._since)
                self._per_step = max(self._per_step, per_step)
            self._read, self._since = step, 0
        if self._reach(ahead) >= self.last_step:
            self._look_after_step(ahead)
        else:
            self._since += ahead

    def _look_after_step(self, ahead: int) -> None:
        """Reads the step right after the batch beginning now ran, and stops
        there if it reached `last_step` (Keras looks at `stop_training`
        after the batch's end); else counts on from it."""
        model = self._fit_model
        train = model.train_function

        def train_and_look(*args: Any) -> Any:
            model.train_function = train  # This batch only.
            result = train(*args)
            step = compat.step_after(result, model, optimizer_step)
            if step is None:  # Not readable here: as counted.
                step = self._reach(ahead)
            if step >= self.last_step:
                self._stop(
                    f"StopAtStep: reached optimizer step {step} (last_step="
                    f"{self.last_step}); stopping.",
                    model,
                )
                events.say("stop", self.stopped, verbose=self.verbose, write=print_msg)
            else:
                self._read, self._since = step, 0
            return result

        train_and_look.keras_ft_train = train  # See `_put_back()`.
        model.train_function = train_and_look

    def on_train_end(self, logs: dict | None = None) -> None:
        _put_back(self._fit_model)
        self._fit_model = None  # Not held past its fit().

    def _reach(self, ahead: int) -> int:
        """The optimizer's step once the batch beginning now has run (at
        most: a step that skips its update counts less)."""
        return self._read + (self._since + ahead) * self._per_step

    def _steps_ahead(self, batch: int) -> int:
        """Training steps the batch beginning now runs: none where its steps
        are skipped (a resumed epoch's trained batches), else one execution
        (the epoch's last may be shorter)."""
        model = self._fit_model
        if skipping(model):
            return 0
        per_execution = getattr(model, "steps_per_execution", 1) or 1
        steps = self.params.get("steps") if self.params else None
        return min(per_execution, steps - batch) if steps else per_execution

    def finished(self, step: int, saved_state: dict | None) -> str | None:
        if step >= self.last_step:
            return (
                f"StopAtStep: the backup is at optimizer step {step}, "
                f"last_step={self.last_step}"
            )
        return None


class StopAtTime(BackupService):
    """Stops training at the first batch end past a wall-clock budget.

    Where Keras calls the batch ends on a thread of its own (every callback
    of the `fit()` is async-safe, on JAX or PyTorch), training stops at the
    first batch end Keras' loop sees after the budget is spent: a step or
    a few later. `BackupAndRestore` backs up the step where it stopped.

    The budget counts from the start of `fit()`. With `total=True` it counts
    across restarts: the time used so far is part of the backup, so a run
    killed after 40 of 60 minutes and resumed has 20 minutes left, and one
    resumed after the budget is spent ends at once without training. With
    `total=False` each `fit()` gets the whole budget again. Either way,
    `BackupAndRestore` backs up the step where training stopped.

    Example:

    ```python
    # A preemptible VM that lives at most an hour: stop with a backup
    # a few minutes before.
    stop = keras_ft.StopAtTime(55 * 60)
    model.fit(x, y, epochs=100,
              callbacks=[keras_ft.BackupAndRestore("/tmp/backup"), stop])
    ```

    Args:
        seconds: The budget, a positive number of seconds.
        total: If `True`, the budget is for the whole training, across
            restarts; if `False`, for each `fit()`. Defaults to `False`.
        verbose: `1` to print one line when training stops, `0` for silence.
            Defaults to `1`.
    """

    # Its batch end reads a clock: Keras may call it on its callback thread.
    async_safe = True

    def __init__(self, seconds: float, total: bool = False, verbose: int = 1):
        super().__init__()
        self.seconds = check_seconds("seconds", seconds)
        self.total = bool(total)
        self.verbose = verbose
        self._used_before = 0.0  # By earlier runs, with `total`.
        self._started = time.monotonic()
        self._fit_model: keras.Model | None = None

    @property
    def used(self) -> float:
        """Seconds of the budget used so far."""
        return self._used_before + time.monotonic() - self._started

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stopped = None
        self._used_before = 0.0
        self._started = time.monotonic()
        # Read here, on the training thread, for batch ends off it.
        self._fit_model = self.model

    def on_train_end(self, logs: dict | None = None) -> None:
        self._fit_model = None  # Not held past its fit().

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        used = self.used
        if used < self.seconds or self.stopped is not None:
            return
        with _stopping:
            if self.stopped is not None:
                return  # Another of Keras' threads got there first.
            spent = "the total budget" if self.total else "the budget"
            self._stop(
                f"StopAtTime: {used:.1f} s used of {spent} of {self.seconds:g} s; "
                "stopping.",
                self._fit_model,
            )
        events.say("stop", self.stopped, verbose=self.verbose, write=print_msg)

    def get_state(self) -> dict:
        return {"used": self.used}

    def set_state(self, state: dict) -> None:
        # Restored at the resume epoch's begin; only a total budget goes on.
        if self.total:
            self._used_before = float(state.get("used", 0.0))

    def finished(self, step: int, saved_state: dict | None) -> str | None:
        used = float((saved_state or {}).get("used", 0.0))
        if self.total and used >= self.seconds:
            return (
                f"StopAtTime: the backup has used {used:.1f} s of the total "
                f"budget of {self.seconds:g} s"
            )
        return None


def _put_back(model: keras.Model | None) -> None:
    """Gives `model` back the train function `StopAtStep` wrapped for one
    batch, if its wrapper is still there (a fit() that ended first)."""
    train = getattr(model, "train_function", None)
    original = getattr(train, "keras_ft_train", None)
    if original is not None:
        model.train_function = original
