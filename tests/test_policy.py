"""Save schedules and retention, driven by hand-fed counters and clocks."""

from __future__ import annotations

import pytest

from keras_ft.policy import AnyOf, EveryEpoch, EveryNSeconds, EveryNSteps, KeepLast
from keras_ft.store import Checkpoint


def saves_on_batches(schedule, steps_per_call, times):
    saved = []
    schedule.start(times[0])
    for i, (steps, now) in enumerate(zip(steps_per_call, times, strict=True)):
        if schedule.on_batch_end(steps, now):
            saved.append(i)
            schedule.saved(now)
    return saved


def test_every_epoch_saves_at_epoch_end_only():
    schedule = EveryEpoch()
    assert not schedule.on_batch_end(1, 0.0)
    assert schedule.on_epoch_end(0.0)


def test_every_n_steps_counts_steps_since_last_save():
    assert saves_on_batches(EveryNSteps(3), [1] * 10, [0.0] * 10) == [2, 5, 8]


def test_every_n_steps_counts_multi_step_executions():
    # steps_per_execution=2: each batch end reports two steps.
    assert saves_on_batches(EveryNSteps(3), [2] * 4, [0.0] * 4) == [1, 3]


def test_every_n_steps_restarts_after_start():
    schedule = EveryNSteps(2)
    schedule.start(0.0)
    schedule.on_batch_end(1, 0.0)
    schedule.start(0.0)
    assert not schedule.on_batch_end(1, 0.0)


def test_every_n_seconds_saves_first_batch_end_past_the_interval():
    times = [0.0, 4.0, 10.5, 12.0, 21.0, 30.4]
    assert saves_on_batches(EveryNSeconds(10), [1] * 6, times) == [2, 4]


def test_any_of_resets_every_schedule_after_any_save():
    schedule = AnyOf(EveryNSteps(5), EveryNSeconds(10))
    times = [0.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    # Time triggers at index 1; the step count then restarts from there.
    assert saves_on_batches(schedule, [1] * 7, times) == [1, 6]


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3"])
def test_every_n_steps_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="Received: n="):
        EveryNSteps(bad)


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), "10", False])
def test_every_n_seconds_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="Received: seconds="):
        EveryNSeconds(bad)


def test_keep_last_selects_the_oldest_beyond_n():
    checkpoints = [Checkpoint(i, f"/x/{i}") for i in range(1, 6)]
    assert [c.sequence for c in KeepLast(2).select_for_deletion(checkpoints)] == [
        1,
        2,
        3,
    ]
    assert KeepLast(10).select_for_deletion(checkpoints) == []


@pytest.mark.parametrize("bad", [0, -1, None, 1.5, True])
def test_keep_last_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="`keep`.*Received: keep="):
        KeepLast(bad)
