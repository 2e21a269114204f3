"""Stop conditions: at an optimizer step, or after a wall-clock budget.

`tf.train.StopAtStepHook` and TensorLayer's `StopAtTimeHook` for `fit()`.
Where one stops training, the `BackupAndRestore` of the same `fit()` backs
up that exact step first, so a later run continues from it.
"""

from __future__ import annotations

import time

from keras_ft import events
from keras_ft.compat import print_msg
from keras_ft.state.training_state import optimizer_step
from keras_ft.training.policy import check_seconds
from keras_ft.training.services import BackupService


class StopAtStep(BackupService):
    """Stops training when the optimizer has taken `last_step` steps.

    The step is the optimizer's `iterations`, which a `BackupAndRestore`
    restores, so the count goes on across restarts: a resumed run stops at
    the same step, and a run resumed from a backup already at `last_step`
    ends at once without training. Training stops at the first batch end
    at or past `last_step` (with `steps_per_execution > 1`, at the end of
    the execution that reaches it), and `BackupAndRestore` backs up that
    step.

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

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stopped = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # On JAX, `self.model` syncs the trainer's state into the variables.
        step = optimizer_step(self.model)
        if step >= self.last_step and self.stopped is None:
            self._stop(
                f"StopAtStep: reached optimizer step {step} (last_step="
                f"{self.last_step}); stopping."
            )
            events.say("stop", self.stopped, verbose=self.verbose, write=print_msg)

    def finished(self, step: int, saved_state: dict | None) -> str | None:
        if step >= self.last_step:
            return (
                f"StopAtStep: the backup is at optimizer step {step}, "
                f"last_step={self.last_step}"
            )
        return None


class StopAtTime(BackupService):
    """Stops training at the first batch end past a wall-clock budget.

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

    def __init__(self, seconds: float, total: bool = False, verbose: int = 1):
        super().__init__()
        self.seconds = check_seconds("seconds", seconds)
        self.total = bool(total)
        self.verbose = verbose
        self._used_before = 0.0  # By earlier runs, with `total`.
        self._started = time.monotonic()

    @property
    def used(self) -> float:
        """Seconds of the budget used so far."""
        return self._used_before + time.monotonic() - self._started

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stopped = None
        self._used_before = 0.0
        self._started = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        used = self.used
        if used >= self.seconds and self.stopped is None:
            spent = "the total budget" if self.total else "the budget"
            self._stop(
                f"StopAtTime: {used:.1f} s used of {spent} of {self.seconds:g} s; "
                "stopping."
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
