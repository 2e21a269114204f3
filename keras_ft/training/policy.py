"""When to save and which checkpoints to keep.

Save schedules and retention policies are small value objects: each answers one
question from counters and clocks handed to it, so they can be combined and
tested without training anything.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from typing import Any

from keras_ft.checkpoint.store import Checkpoint


def check_seconds(name: str, value: Any, zero: bool = False) -> float:
    """`value` as a float, or a `ValueError` naming argument `name`: a finite
    number of seconds, positive (or, with `zero`, non-negative)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        expected = "a non-negative" if zero else "a positive"
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected {expected}, finite "
            f"number of seconds. Received: {name}={value!r}"
        )
    return float(value)


class SaveSchedule:
    """Decides, at each batch end and epoch end, whether a save is due.

    A schedule is told how many optimizer steps ran since the previous batch
    end, the time, whether a save was still being written in the background,
    and when a save happened. It keeps no other state, so a schedule can be
    reset with `start()` and reused across `fit()` calls.
    """

    def start(self, now: float) -> None:
        """Called at train begin: forget everything of a previous run."""

    def on_batch_end(self, steps: int, now: float, writing: bool = False) -> bool:
        """Whether to save after a batch end that completed `steps` steps.

        Args:
            steps: Optimizer steps since the previous batch end.
            now: The time.
            writing: Whether a save was being written in the background
                during those steps. Defaults to `False`.
        """
        return False

    def on_epoch_end(self, now: float) -> bool:
        """Whether to save at the end of an epoch."""
        return False

    def saved(self, now: float, cost: float = 0.0) -> None:
        """Called after every save, whichever schedule asked for it.

        Args:
            now: The time the save returned.
            cost: Seconds the save held up training.
        """


class Never(SaveSchedule):
    """Never asks for a save: only a preemption signal backs up.

    What `save_freq=False` means, as in Keras' own `BackupAndRestore`.
    """

    def __repr__(self) -> str:
        return "Never()"


class EveryEpoch(SaveSchedule):
    """Saves at the end of every epoch."""

    def on_epoch_end(self, now: float) -> bool:
        return True

    def __repr__(self) -> str:
        return "EveryEpoch()"


class EveryNSteps(SaveSchedule):
    """Saves once `n` optimizer steps have run since the last save.

    Args:
        n: Positive number of steps (batches) between saves.
    """

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"Invalid value for argument `n`. Expected a positive integer. "
                f"Received: n={n!r}"
            )
        self.n = n
        self._steps = 0

    def start(self, now: float) -> None:
        self._steps = 0

    def on_batch_end(self, steps: int, now: float, writing: bool = False) -> bool:
        self._steps += steps
        return self._steps >= self.n

    def saved(self, now: float, cost: float = 0.0) -> None:
        self._steps = 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryNSeconds(SaveSchedule):
    """Saves at the first batch end `seconds` after the last save.

    Like `tf.train.Supervisor(save_model_secs=...)`: the clock starts at train
    begin, so the first save comes `seconds` into training.

    Args:
        seconds: Positive number of seconds between saves.
    """

    def __init__(self, seconds: float):
        self.seconds = check_seconds("seconds", seconds)
        self._last = 0.0

    def start(self, now: float) -> None:
        self._last = now

    def on_batch_end(self, steps: int, now: float, writing: bool = False) -> bool:
        return now - self._last >= self.seconds

    def saved(self, now: float, cost: float = 0.0) -> None:
        self._last = now

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds})"


class Continuous(SaveSchedule):
    """Saves at every batch end at which the last backup is committed.

    Orbax's continuous checkpointing, for keras-ft's background writes: the
    fewest batches lost to a kill (about one write's time of training) for
    one blocking copy of the state per save and a write always running
    beside training. Worth it where the host has cores and disk bandwidth to
    spare (an accelerator does the training); on a busy CPU host,
    `OverheadBudget` (`save_freq="auto"`) holds the cost to a budget.
    """

    def on_batch_end(self, steps: int, now: float, writing: bool = False) -> bool:
        return not writing

    def __repr__(self) -> str:
        return "Continuous()"


class OverheadBudget(SaveSchedule):
    """Saves as often as keeps the time saves add to training within a budget.

    A clean step's time is the median of recent steps taken away from saves
    (nothing being written, a few steps after the last save), so neither
    noise nor the tail of a save's slowdown pulls it up. A save's cost is the
    time it blocks (with background writes, the copy to host memory plus any
    wait for the previous write) plus what the steps after it, up to the
    next save, take beyond clean steps: a background write takes CPU, memory
    bandwidth and I/O from the steps beside it. The next save is planned
    once the last one's write has ended and training has settled, from the
    cost seen so far (a save's cost is believed quicker when it rises than
    when it falls): every `ceil(save_cost / (budget * step_time))` steps. So
    even the first interval counts the background write, not only the
    blocking copy. The first save comes after `warmup_steps` steps, to
    measure it. Time between epochs (validation, other callbacks) is not
    counted.

    Args:
        budget: Fraction of training time saves may take, in (0, 1).
            Defaults to `0.02`.
        warmup_steps: Steps before the first save. Defaults to `10`.
    """

    def __init__(self, budget: float = 0.02, warmup_steps: int = 10):
        if (
            isinstance(budget, bool)
            or not isinstance(budget, (int, float))
            or not 0 < budget < 1
        ):
            raise ValueError(
                "Invalid value for argument `overhead_budget`. Expected a "
                "fraction of training time between 0 and 1, e.g. 0.02. "
                f"Received: overhead_budget={budget!r}"
            )
        self.budget = float(budget)
        self.warmup_steps = warmup_steps
        self.start(0.0)

    def start(self, now: float) -> None:
        self.interval: int | None = None
        self.step_time: float | None = None
        self.save_cost: float | None = None
        self._clean_steps: collections.deque[float] = collections.deque(
            maxlen=_CLEAN_STEPS_KEPT
        )
        self._steps = 0
        self._last_end: float | None = None
        self._blocked: float | None = None  # By the last save, if any.
        self._excess = 0.0  # Step time beyond `step_time` since that save.
        self._since_save = _SETTLE_STEPS
        self._planned = True  # Whether the next save is planned.

    def on_batch_end(self, steps: int, now: float, writing: bool = False) -> bool:
        if self._last_end is not None and steps > 0:
            seconds = now - self._last_end
            if not writing and self._since_save >= _SETTLE_STEPS:
                self._clean_steps.append(seconds / steps)
                self.step_time = statistics.median(self._clean_steps)
            if self._blocked is not None and self.step_time is not None:
                self._excess += seconds - steps * self.step_time
        self._since_save += steps
        self._last_end = now
        self._steps += steps
        if not self._planned:
            if writing or self._since_save < _SETTLE_STEPS or not self.step_time:
                return False  # The last save's cost is not known yet.
            seen = self._blocked + max(0.0, self._excess)
            self._plan(max(seen, self.save_cost or 0.0))
        return self._steps >= (self.interval or self.warmup_steps)

    def on_epoch_end(self, now: float) -> bool:
        self._last_end = None  # What comes between epochs is no step.
        return False

    def saved(self, now: float, cost: float = 0.0) -> None:
        # The previous save's whole cost is known by now.
        if self._blocked is not None and self.step_time:
            whole = self._blocked + max(0.0, self._excess)
            self.save_cost = _average(self.save_cost, whole, up=0.5)
        self._blocked, self._excess, self._since_save = cost, 0.0, 0
        self._planned = False
        self._steps = 0
        self._last_end = now  # The next step's time starts after the save.

    def _plan(self, save_cost: float) -> None:
        steps = save_cost / (self.budget * self.step_time)
        # Less a hair, so float noise on an exact ratio does not round up.
        self.interval = max(1, math.ceil(steps - 1e-9))
        self._planned = True

    def __repr__(self) -> str:
        return f"OverheadBudget({self.budget})"


# Steps after a save before a step counts as clean (caches warm again), and
# how many recent clean steps the step time is the median of.
_SETTLE_STEPS = 2
_CLEAN_STEPS_KEPT = 64


def _average(previous: float | None, value: float, up: float = 0.2) -> float:
    # An exponential moving average: steady, yet follows a changing load;
    # with a larger `up`, quicker to believe a rise than a fall.
    if previous is None:
        return value
    weight = up if value > previous else 0.2
    return (1 - weight) * previous + weight * value


class AnyOf(SaveSchedule):
    """Saves when any of several schedules asks for it.

    After any save every schedule restarts its count, so that "every 100 steps
    or every 10 minutes" never saves twice in a row for the same progress.
    """

    def __init__(self, *schedules: SaveSchedule):
        self.schedules = schedules

    def start(self, now: float) -> None:
        for schedule in self.schedules:
            schedule.start(now)

    def on_batch_end(self, steps: int, now: float, writing: bool = False) -> bool:
        # Every schedule must see every batch, so no short-circuiting `any`.
        answers = [s.on_batch_end(steps, now, writing) for s in self.schedules]
        return any(answers)

    def on_epoch_end(self, now: float) -> bool:
        return any([s.on_epoch_end(now) for s in self.schedules])

    def saved(self, now: float, cost: float = 0.0) -> None:
        for schedule in self.schedules:
            schedule.saved(now, cost)

    def __repr__(self) -> str:
        return f"AnyOf{self.schedules!r}"


class KeepLast:
    """Keeps the `n` newest committed checkpoints.

    Args:
        n: How many to keep, at least 1.
    """

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                "Invalid value for argument `keep`. Expected a positive integer "
                f"(the number of checkpoints to keep). Received: keep={n!r}"
            )
        self.n = n

    def select_for_deletion(
        self, checkpoints: Sequence[Checkpoint]
    ) -> list[Checkpoint]:
        return list(checkpoints[: max(0, len(checkpoints) - self.n)])

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


def schedule_from_arguments(
    save_freq: str | int | bool,
    overhead_budget: float,
    save_every_seconds: float | None,
) -> AnyOf:
    """The schedule `BackupAndRestore`'s arguments ask for, validated.

    Raises:
        ValueError: naming the argument, the value and what it may be.
    """
    if save_freq is False:
        schedules: list[SaveSchedule] = [Never()]
    elif save_freq == "epoch":
        schedules = [EveryEpoch()]
    elif save_freq == "auto":
        schedules = [OverheadBudget(overhead_budget)]
    elif save_freq == "continuous":
        schedules = [Continuous()]
    elif (
        isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
    ):
        schedules = [EveryNSteps(save_freq)]
    else:
        raise ValueError(
            "Invalid value for argument `save_freq`. Expected 'epoch', 'auto', "
            "'continuous', a positive integer number of batches, or False (only "
            "the backup taken on a preemption signal). Received: "
            f"save_freq={save_freq!r}"
        )
    OverheadBudget(overhead_budget)  # Validated whatever `save_freq` is.
    if save_every_seconds is not None:
        try:
            schedules.append(EveryNSeconds(save_every_seconds))
        except ValueError:
            raise ValueError(
                "Invalid value for argument `save_every_seconds`. Expected a "
                "positive number of seconds or `None`. Received: "
                f"save_every_seconds={save_every_seconds!r}"
            ) from None
    return AnyOf(*schedules)


def check_same_step_on_every_worker(
    schedule: AnyOf, num_workers: int, save_freq: object, save_every_seconds: object
) -> None:
    """Refuses schedules that workers could disagree on.

    Raises:
        ValueError: with several workers, for a schedule that reads a clock.
    """
    if num_workers == 1:
        return
    timed = (EveryNSeconds, OverheadBudget, Continuous)
    if any(isinstance(s, timed) for s in schedule.schedules):
        raise ValueError(
            f"With {num_workers} workers, every worker must save at the "
            "same step, so saves cannot depend on each worker's clock. "
            "Use `save_freq='epoch'` or an integer number of batches "
            "instead of `save_freq='auto'`, `'continuous'` or "
            "`save_every_seconds`. "
            f"Received: save_freq={save_freq!r}, "
            f"save_every_seconds={save_every_seconds!r}"
        )


def budget_of(schedule: AnyOf) -> OverheadBudget | None:
    """The `OverheadBudget` among a schedule's parts, if any."""
    return next((s for s in schedule.schedules if isinstance(s, OverheadBudget)), None)


def local_schedule(
    local_save_freq: str | int | None, local_dir: str | None
) -> SaveSchedule:
    """The local tier's own schedule, validated (`Never()` if it has none)."""
    if local_save_freq is None:
        return Never()
    if local_dir is None:
        raise ValueError(
            "Invalid value for argument `local_save_freq`: it is the schedule of "
            "the local tier, and `local_dir` is None. Pass local_dir too, or "
            f"local_save_freq=None. Received: local_save_freq={local_save_freq!r}"
        )
    if local_save_freq == "epoch":
        return EveryEpoch()
    if (
        isinstance(local_save_freq, int)
        and not isinstance(local_save_freq, bool)
        and local_save_freq > 0
    ):
        return EveryNSteps(local_save_freq)
    raise ValueError(
        "Invalid value for argument `local_save_freq`. Expected 'epoch', a "
        "positive integer number of batches, or None. Received: "
        f"local_save_freq={local_save_freq!r}"
    )
