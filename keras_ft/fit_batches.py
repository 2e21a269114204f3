"""The callback's training batches: where a `fit()` is in its epoch, and what
each batch's end does (the stall deadline, goodput, a preemption stop, the
save schedules).

`BackupAndRestore` hands every batch begin and end here. Whether a batch's
end is handled at Keras' batch end or at the next batch's begin is
`training/batch_ends.py`'s; what a save holds and does is `FitSaves`'.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import keras

from keras_ft import compat, events
from keras_ft.fit_saves import FitSaves
from keras_ft.training import batch_ends
from keras_ft.training.goodput import GoodputRecorder
from keras_ft.training.preemption import Preemption
from keras_ft.training.watchdog import FitDeadline
from keras_ft.worker_training_state import WorkerTrainingState


class FitBatches:
    """One `fit()`'s training batches (see the module's docstring).

    Args:
        model: Returns the model, its variables current (on JAX, the
            callback's `model` property syncs the trainer's state).
        steps: Batches in an epoch (`None` when the input has no length).
        state: The training's `WorkerTrainingState`.
        saves: The fit's `FitSaves`.
        schedule: When to save to the backup (`policy.SaveSchedule`).
        local_schedule: When to save to the local tier alone.
        preemption: The fit's `Preemption` (started).
        deadline: The stall deadline (`watchdog.FitDeadline`).
        goodput: Where productive time is recorded, if anywhere.
        optimizer_step: Returns the optimizer's step, for goodput.
    """

    def __init__(
        self,
        model: Callable[[], keras.Model],
        steps: int | None,
        state: WorkerTrainingState,
        saves: FitSaves,
        schedule: Any,
        local_schedule: Any,
        preemption: Preemption,
        deadline: FitDeadline,
        goodput: GoodputRecorder | None,
        optimizer_step: Callable[[], int],
    ):
        self._model, self._steps = model, steps
        self._state, self._saves = state, saves
        self._schedule, self._local_schedule = schedule, local_schedule
        self._preemption, self._deadline = preemption, deadline
        self._goodput, self._optimizer_step = goodput, optimizer_step
        self._ends = batch_ends.BatchEnds()
        self._ends.start()
        self.epoch = 0
        self.done = 0  # Batches of this epoch handled, on the training thread.
        self.skip_until = 0  # Batches trained before the restart, skipped now.
        self.preempted_by: str | None = None
        self.signum: signal.Signals | None = None

    def position(self) -> tuple[int, int]:
        """The epoch, and the batches of it handled."""
        return self.epoch, self.done

    def epoch_begin(self, epoch: int) -> None:
        self.epoch = epoch
        self.done = self.skip_until = 0
        self._ends.epoch_begin()

    def train_batch_begin(self, batch: int) -> None:
        # Past the batches handled: its end was on Keras' callback thread.
        if batch > self.done and self._ended(batch, None):
            model = self._model()
            batch_ends.skip_next_step(model, self._ends.logs(batch, model, None))

    def train_batch_end(self, batch: int, logs: dict | None) -> None:
        # With steps_per_execution > 1, `batch` is the last of several steps.
        if self._ends.here():
            self._ended(batch + 1, logs)
            return
        # Keras' callback thread (`async_safe`): the stall deadline hears of
        # it now; the rest waits for the next batch's begin.
        self._deadline.batch_ended(last_of_epoch=batch + 1 == self._steps)
        self._ends.note(batch + 1, logs)

    def epoch_end(self) -> None:
        """Handles the epoch's last batch, if its end was on Keras' thread;
        or a signal that came since it (in validation): the epoch's
        training is over, backed up as it is."""
        unhandled = self._ends.unhandled(self.done)
        if self.preempted_by:
            return
        if unhandled is not None:
            self._ended(unhandled[0], None)  # Its noted logs, if read.
            return
        signum = self._preemption.pending_alone()
        if signum is not None:
            self._stop_for_preemption(None, signum)

    def _ended(self, done: int, logs: dict | None) -> bool:
        """A batch's end, `done` batches into the epoch, on the training
        thread; `logs` is `None` at the next batch's begin (the deadline has
        heard of it then), and read only for a save. Returns whether it
        stopped `fit()` for a preemption."""
        if logs is not None:
            self._deadline.batch_ended(last_of_epoch=done == self._steps)
        if self._goodput is not None:
            self._goodput.batch_end(self._optimizer_step, self._saves.backup_seconds)
        steps = done - self.done
        self.done = done
        self._saves.run(self._state.raise_if_failed)
        signum = self._preemption.at_batch_end(self._state.task.task_index)
        if signum is not None:
            self._stop_for_preemption(logs, signum)
            return True
        if done <= self.skip_until:
            return False  # A batch trained before the restart, skipped now.
        writing = self._state.writing
        now = time.monotonic()
        to_bucket = self._schedule.on_batch_end(steps, now, writing)
        if to_bucket or self._local_schedule.on_batch_end(steps, now, writing):
            # On JAX, reading the model syncs the trainer's state back into
            # its variables, which fit() leaves stale mid-epoch.
            model = self._model()
            logs = self._ends.logs(done, model, logs)
            self._saves.save(model, logs, self.epoch, done, to_bucket=to_bucket)
            if to_bucket:
                self._saves.report_interval()
        return False

    def _stop_for_preemption(self, logs: dict | None, signum: signal.Signals) -> None:
        self.signum = signum
        # A batch skipped after a restart: the backup restored from holds it.
        held = self.done <= self.skip_until
        model = self._model()
        logs = self._ends.logs(self.done, model, logs)
        saved = self._saves.save_now(model, logs, self.epoch, self.done, held)
        self.preempted_by = signum.name
        model.stop_training = True
        events.say(
            "preemption",
            self._preemption.report(signum, saved),
            level=logging.WARNING,
            write=compat.print_msg,
        )
