"""The callback's saves: the state a save holds beside the variables, a
diverged state skipped, and what a failed write does (`on_save_error`).

`BackupAndRestore` decides when to save (its schedules) and calls `save()`;
everything about the save itself, and every error a save or a wait for one
raises, is handled here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras

from keras_ft import compat, events
from keras_ft.backend import finiteness
from keras_ft.epoch_end import Action, Decision, EpochEnd
from keras_ft.errors import CheckpointWriteError, NonFiniteStateError
from keras_ft.fit_begin import histories_before, record_history
from keras_ft.state import ResumePoint, rng
from keras_ft.state.training_state import progress_text
from keras_ft.training import batch_ends, callback_state, inputs, neighbours, policy
from keras_ft.training.validation_input import ValidationStream
from keras_ft.worker_training_state import WorkerTrainingState


class FitSaves:
    """One `fit()`'s saves (see the module's docstring).

    Args:
        state: The training's `WorkerTrainingState`.
        schedule: When to save to the backup (`policy.SaveSchedule`).
        local_schedule: When to save to the local tier alone.
        callbacks: The fit's other callbacks (their state is saved).
        position: Where the input pipeline is (saved mid-epoch).
        on_save_error: `"raise"` or `"warn"` (see `BackupAndRestore`).
        verbose: `BackupAndRestore`'s `verbose`.
        on_raise: What to stop before a write error ends `fit()` (Keras
            calls no `on_train_end` then).
        backs_up_stopped_epochs: Whether an epoch another callback cut
            short is backed up where it stopped (the user asked for saves
            beyond preemption ones).
    """

    @classmethod
    def of(
        cls,
        callback: Any,
        state: WorkerTrainingState,
        position: inputs.InputPosition,
        on_raise: Callable[[], None],
    ) -> FitSaves:
        """The saves of `callback`'s (a `BackupAndRestore`'s) current fit()."""
        saves = cls(
            state,
            callback._schedule,
            callback._local_schedule,
            callback._callbacks,
            position,
            callback.on_save_error,
            callback.verbose,
            on_raise=on_raise,
            backs_up_stopped_epochs=callback._backs_up_stopped_epochs,
        )
        saves.epoch_batches = (callback.params or {}).get("steps")
        return saves

    def __init__(
        self,
        state: WorkerTrainingState,
        schedule: Any,
        local_schedule: Any,
        callbacks: callback_state.FitCallbacks,
        position: inputs.InputPosition,
        on_save_error: str,
        verbose: int,
        on_raise: Callable[[], None],
        backs_up_stopped_epochs: bool,
    ):
        self.state = state
        self._schedule, self._local_schedule = schedule, local_schedule
        self._callbacks, self._inputs = callbacks, position
        self._on_save_error, self._verbose = on_save_error, verbose
        self._on_raise = on_raise
        self._backs_up_stopped_epochs = backs_up_stopped_epochs
        # An epoch-end save that callbacks after this one may change: saved
        # again once they have run, `(epoch, logs, to_bucket)`.
        self._pending_epoch_end: tuple[int, dict | None, bool] | None = None
        self.backup_seconds = 0.0  # Training held up by saves, this fit().
        self.last = None  # `(epoch, batch)` of the last save started.
        # Why the last state was not backed up (not finite), if it was not.
        self.skipped_non_finite: str | None = None
        # The random generators at the epoch's begin (saved mid-epoch).
        self.epoch_begin_rng: dict = {}
        # The generators as the epoch's validation began: a save taken in it
        # (a signal) is of the trained epoch, which a resume validates again;
        # the validation's own draws (PyTorch's DataLoader seeds itself from
        # the global generator) must not count twice.
        self.validation_rng: dict | None = None
        # And the metrics as training left them (the validation resets
        # them): the epoch's logs a resume gives that epoch's end.
        self._validation_metrics: list | None = None
        # Where a validation generator stands (set at train begin).
        self.validation = ValidationStream()
        self._reported_interval: int | None = None
        self._told_unsaved = False  # Of callbacks whose state no save holds.
        # The batches an epoch of this fit() has (Keras' `params["steps"]`):
        # a mid-epoch position counts them.
        self.epoch_batches: int | None = None

    def save(
        self,
        model: keras.Model,
        logs: dict | None,
        epoch: int,
        batch: int | None,
        *,
        pending: Sequence[keras.callbacks.Callback] = (),
        replaces_last: bool = False,
        to_bucket: bool = True,
    ) -> bool:
        """Backs up the state now; returns whether a save was started.

        `model` is the callback's `self.model`, passed in so that the caller
        reads it, which on JAX syncs the trainer's state into the variables.

        `pending`: later callbacks whose epoch end has not run yet (noted
        in the backup, so that a resume from it can say so). `to_bucket`:
        `False` for a save to the local tier alone.
        """
        # As a refusal found later by the writer says it (`progress_text()`).
        where = progress_text(epoch if batch else epoch + 1, batch or 0)
        if not _finite_loss(logs):
            self.skip_non_finite(f"the loss is {logs.get('loss')} at {where}")
            return False
        started = time.monotonic()
        extra = self._extra(logs, epoch, batch, pending)
        how = {"replaces_last": replaces_last, "to_bucket": to_bucket}

        def back_up() -> None:
            # Weights swapped in for evaluation (SwapEMAWeights) are not
            # the training's: swapped out for the snapshot.
            with neighbours.training_weights(self._callbacks.others):
                take()

        def take() -> None:
            try:
                self.state.back_up(epoch, batch, extra, **how)
            except NonFiniteStateError as e:
                if e.at is None:
                    raise  # This state's.
                # An earlier save's, found by its writer's check, raised
                # before this one started: reported, then this one goes on.
                self.skip_non_finite(_non_finite_text(e))
                self.state.back_up(epoch, batch, extra, **how)

        try:
            self.run(back_up)
        except NonFiniteStateError as e:
            self.skip_non_finite(_non_finite_text(e, where))
            return False
        now = time.monotonic()
        if to_bucket:
            self._schedule.saved(now, cost=now - started)
        self._local_schedule.saved(now, cost=now - started)
        self.backup_seconds += now - started
        self.last = (epoch, batch)
        self.skipped_non_finite = None
        return True

    def with_schedules(self, end: EpochEnd) -> EpochEnd:
        """`end` with the schedules' verdicts, where they are asked."""
        if not end.asks_schedules:
            return end
        now = time.monotonic()
        return dataclasses.replace(
            end,
            scheduled=self._schedule.on_epoch_end(now),
            scheduled_locally=self._local_schedule.on_epoch_end(now),
            later_stateful=bool(self._callbacks.later_stateful()),
        )

    def at_epoch_end(
        self, model: keras.Model, logs: dict | None, end: EpochEnd, decision: Decision
    ) -> None:
        """Backs up what `decide(end)` said to, `decision`."""
        if decision.action is Action.SAVE_STOPPED:
            self.save(model, logs, end.epoch, end.done)
            return
        # The epoch is backed up now, whatever a later callback does. Those
        # that keep state update it in their own on_epoch_end: a second
        # backup, once they have run, replaces this one.
        later = self._callbacks.later_stateful() if decision.again_after_all else []
        to_bucket = decision.to_bucket
        saved = self.save(
            model, logs, end.epoch, None, pending=later, to_bucket=to_bucket
        )
        if saved and decision.again_after_all:
            self._pending_epoch_end = (end.epoch, logs, to_bucket)

    def after_every_epoch_end(self, model: keras.Model, epoch: int) -> None:
        """Once every callback's epoch end ran: the epoch's save again, if
        a later callback could have changed its state."""
        pending, self._pending_epoch_end = self._pending_epoch_end, None
        if pending is not None and pending[0] == epoch:
            self.save(
                model, pending[1], epoch, None, replaces_last=True, to_bucket=pending[2]
            )

    def save_now(
        self,
        model: keras.Model,
        logs: dict | None,
        epoch: int,
        batch: int,
        held: bool = False,
    ) -> str:
        """Backs up the state after `batch` batches of `epoch` and waits for
        its commit (the process may be gone soon), unless the backup already
        `held` that point (a batch skipped after a restart); returns what
        became of it, in words."""
        where = f"epoch {epoch + 1}, batch {batch}"
        if held:
            return f"the backup already holds {where}"
        if not self.save(model, logs, epoch, batch):
            return f"{where} is not finite and was not backed up"
        checkpoint = self.run(self.state.wait)
        if checkpoint is not None:
            return f"backed up {where} to {checkpoint.path}"
        if self.skipped_non_finite:  # Found by the writer's check.
            return f"{where} is not finite and was not backed up"
        return f"backed up {where}"  # On a worker: the chief commits.

    def note_history(self, later_fit: ResumePoint | None) -> None:
        """At train end: notes this fit()'s `History` for the script's later
        fits' backups to hold; where `later_fit` (a later fit's backup, so
        this one trained nothing) holds it, gives it back first, as the
        uninterrupted run returned it."""
        history = next(
            (
                c
                for c in self._callbacks.others
                if isinstance(c, keras.callbacks.History)
            ),
            None,
        )
        number = self.state.fit_number
        if history is None or number is None:
            return
        saved = later_fit.extra.get("histories", []) if later_fit else []
        if len(saved) >= number and saved[number - 1]:
            callback_state.apply([history], {"History:0": saved[number - 1]})
        state = callback_state.capture([history])["History:0"]
        record_history(self.state.backup_dir, number, state)

    def end(self, delete: bool) -> None:
        """At train end: deletes the backup (`delete`), or waits for the
        saves in flight to commit and lets go of it."""
        if not delete:
            self.run(self.state.close)
            return
        if self.skipped_non_finite:
            events.warn(
                "save",
                f"BackupAndRestore: fit() ran every epoch, but "
                f"{self.skipped_non_finite}, so it was not backed up. The backup "
                "of the last finite state is deleted, as `delete_checkpoint=True` "
                "asks; pass `delete_checkpoint=False` to keep it.",
                stacklevel=3,
            )
        # The backup goes: no need to finish writing the last save.
        self.run(self.state.discard_pending)
        self.state.delete_backup()

    def _extra(
        self,
        logs: dict | None,
        epoch: int,
        batch: int | None,
        pending: Sequence[keras.callbacks.Callback],
    ) -> dict:
        """What a save holds beside the variables."""
        others = self._callbacks.others
        extra = {
            # At an epoch end, the next epoch begins with the generators as now.
            "epoch_begin_rng": rng.capture() if batch is None else self.epoch_begin_rng,
            "logs": batch_ends.numbers(logs),
            "callbacks": callback_state.capture(
                callback_state.with_epoch_recorded(others, epoch, logs, batch)
            ),
            # Which of the script's fit() calls sharing the backup this is.
            "fit": self.state.fit_number or 1,
        }
        earlier = histories_before(self.state.backup_dir, self.state.fit_number)
        if earlier:  # The History each returned, for a rerun's to return.
            extra["histories"] = earlier
        if not self._told_unsaved:
            self._told_unsaved = True
            callback_state.warn_unsaved(others, extra["callbacks"])
            self._inputs.warn_unsaved()
        if pending:
            extra["callbacks_pending"] = self._callbacks.keys(list(pending))
        in_validation = bool(batch and self.validation_rng is not None)
        if in_validation:
            extra["rng"] = self.validation_rng
            extra["metrics"] = self._validation_metrics
        drawn = self.validation.drawn(in_validation)
        if drawn is not None:
            extra["validation_drawn"] = drawn
        if batch:  # Saved in the batch's end, before theirs.
            behind = self._callbacks.later_batch_counters()
            if behind:
                extra["callbacks_behind"] = self._callbacks.keys(behind)
        dataset = self._inputs.dataset_state()
        if dataset is not None:
            extra["dataset"] = dataset
        variables = self._inputs.variable_values(batch)
        if variables is not None:
            extra["input_variables"] = variables
        iterators = self._inputs.iterators_made(batch)
        if iterators is not None:
            extra["input_iterators"] = iterators
        if batch and self.epoch_batches:
            extra["epoch_batches"] = self.epoch_batches
        if batch:  # Counted in the save's cost: a tf.data state may be large.
            position = self._inputs.state_at(batch)
            if position is not None:
                extra["input"] = position
        stream = self._inputs.stream_at(batch or None)
        if stream is not None:
            extra.setdefault("input", {}).update(stream)
        return extra

    def validation_begins(self, model: keras.Model) -> None:
        """At a validation's begin in `fit()`, before its data pipeline draws
        and before it resets the metrics."""
        self.validation_rng = rng.capture()
        self._validation_metrics = [
            keras.ops.convert_to_numpy(v) for v in model.metrics_variables
        ]
        self.validation.test_begin(model)

    def epoch_begins(self) -> None:
        """At an epoch's begin: no validation of it has begun."""
        self.validation_rng = self._validation_metrics = None

    def skip_non_finite(self, what: str) -> None:
        self.skipped_non_finite = what
        events.warn(
            "stop",
            f"BackupAndRestore: {what}; not backing up a diverged model. The "
            "last good backup is kept.",
            stacklevel=4,
        )

    def report_interval(self) -> None:
        """Says the interval `save_freq="auto"` chose, when it changes much."""
        budget = policy.budget_of(self._schedule)
        if budget is None or budget.interval is None:
            return
        reported = self._reported_interval
        if reported is None or not reported / 2 <= budget.interval <= reported * 2:
            self._reported_interval = budget.interval
            events.say(
                "save",
                f"BackupAndRestore: saving every {budget.interval} steps (a save "
                f"holds training up {budget.save_cost * 1000:.0f} ms, a step "
                f"takes {budget.step_time * 1000:.1f} ms; budget "
                f"{budget.budget:.1%}).",
                verbose=self._verbose,
                write=compat.print_msg,
            )

    def run(self, step: Callable[[], Any]) -> Any:
        """Runs `step`; a failed write raises, or warns with `on_save_error`.

        A save its writer refused as not finite (checked in the background)
        warns, as one refused at once does.
        """
        try:
            return step()
        except NonFiniteStateError as e:
            if e.at is None:
                raise
            self.skip_non_finite(_non_finite_text(e))
            return None
        except CheckpointWriteError as e:
            if self._on_save_error == "warn":
                events.warn("save", f"BackupAndRestore: {e.strerror}", stacklevel=3)
                return None
            # fit() ends here without calling on_train_end.
            self._on_raise()
            self.state.unlock()
            raise


def _non_finite_text(error: NonFiniteStateError, where: str | None = None) -> str:
    shown = ", ".join(error.variables[:3])
    return f"{shown} hold NaN or infinity at {error.at or where}"


def _finite_loss(logs: dict | None) -> bool:
    return finiteness.finite_number((logs or {}).get("loss"))
