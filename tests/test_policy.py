"""Save schedules and retention, driven by hand-fed counters and clocks."""

from __future__ import annotations

import pytest

from keras_ft.checkpoint.store import Checkpoint
from keras_ft.training import policy
from keras_ft.training.policy import (
    AnyOf,
    EveryEpoch,
    EveryNSeconds,
    EveryNSteps,
    KeepLast,
    OverheadBudget,
)


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


def test_overhead_budget_spaces_saves_to_fit_the_budget():
    schedule = OverheadBudget(budget=0.02, warmup_steps=3)
    schedule.start(0.0)
    now, saves = 0.0, []
    for step in range(1, 400):
        now += 0.010  # A 10 ms step.
        if schedule.on_batch_end(1, now):
            saves.append(step)
            now += 0.005  # A save blocks training for 5 ms.
            schedule.saved(now, cost=0.005)
    # 5 ms per save within 2 % of 10 ms steps: one save every 25 steps.
    assert saves[0] == 3 and schedule.interval == 25
    assert all(b - a == 25 for a, b in zip(saves[1:], saves[2:], strict=False))
    overhead = len(saves) * 0.005 / (399 * 0.010)
    assert overhead <= 0.02 + 0.005 / (399 * 0.010)


def run_steps(schedule, now, seconds, writing=False):
    """Batch ends of steps that take `seconds` each; returns the time after."""
    for duration in seconds:
        now += duration
        schedule.on_batch_end(1, now, writing=writing)
    return now


def test_overhead_budget_follows_a_slower_save():
    schedule = OverheadBudget(budget=0.1, warmup_steps=1)
    schedule.start(0.0)
    now = run_steps(schedule, 0.0, [0.01] * 2)
    schedule.saved(now, cost=0.001)
    now = run_steps(schedule, now, [0.01] * 3)
    fast = schedule.interval
    for _ in range(20):
        schedule.saved(now, cost=0.1)
        now = run_steps(schedule, now, [0.01] * 3)
    assert schedule.interval > 10 * fast


def test_overhead_budget_counts_steps_slowed_by_a_background_write():
    schedule = OverheadBudget(budget=0.02, warmup_steps=1)
    schedule.start(0.0)
    now = run_steps(schedule, 0.0, [0.010] * 3)
    schedule.saved(now, cost=0.002)  # Blocks 2 ms; then written beside 4 steps
    now = run_steps(schedule, now, [0.015] * 4, writing=True)  # of 15 ms, not 10.
    now = run_steps(schedule, now, [0.010] * 200)
    schedule.saved(now, cost=0.002)
    # 2 ms blocked + 4 x 5 ms slower steps.
    assert schedule.save_cost == pytest.approx(0.022)
    assert schedule.step_time == pytest.approx(0.010)


def test_overhead_budget_plans_the_first_interval_once_the_write_is_over():
    schedule = OverheadBudget(budget=0.02, warmup_steps=1)
    schedule.start(0.0)
    now = run_steps(schedule, 0.0, [0.010] * 3)
    schedule.saved(now, cost=0.002)
    for _ in range(4):  # No save while the last one is being written,
        now += 0.015
        assert not schedule.on_batch_end(1, now, writing=True)
    assert schedule.interval is None
    now = run_steps(schedule, now, [0.010] * 2)
    # and then one whose interval counts what the write cost, not only the
    # 2 ms it blocked: 22 ms within 2 % of 10 ms steps.
    assert schedule.interval == 110


def test_overhead_budget_step_time_ignores_a_few_slow_steps():
    schedule = OverheadBudget(budget=0.02, warmup_steps=1000)
    schedule.start(0.0)
    run_steps(schedule, 0.0, [0.010, 0.010, 0.040, 0.010, 0.012, 0.010] * 10)
    assert schedule.step_time == pytest.approx(0.010)


def test_overhead_budget_leaves_time_between_epochs_out():
    schedule = OverheadBudget(budget=0.02, warmup_steps=1)
    schedule.start(0.0)
    now = 0.0
    for _ in range(3):
        now += 0.010
        schedule.on_batch_end(1, now)
    schedule.saved(now, cost=0.002)
    for _ in range(2):
        for _ in range(20):
            now += 0.010
            schedule.on_batch_end(1, now)
        schedule.on_epoch_end(now)
        now += 5.0  # Validation.
    schedule.saved(now, cost=0.002)
    assert schedule.save_cost == pytest.approx(0.002)
    assert schedule.step_time == pytest.approx(0.010)


@pytest.mark.parametrize("bad", [0, 1, -0.5, 2, "2%", True])
def test_overhead_budget_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="`overhead_budget`.*Received"):
        OverheadBudget(bad)


def test_save_freq_false_never_asks_for_a_save():
    schedule = policy.schedule_from_arguments(False, 0.02, None)
    schedule.start(0.0)
    assert not any(schedule.on_batch_end(1, float(t)) for t in range(1000))
    assert not schedule.on_epoch_end(1000.0)
    # With a clock as well, only the clock asks.
    timed = policy.schedule_from_arguments(False, 0.02, 5.0)
    timed.start(0.0)
    assert not timed.on_epoch_end(1.0)
    assert timed.on_batch_end(1, 6.0)


@pytest.mark.parametrize("bad", [0, -1, True, "batch", 2.0, None])
def test_save_freq_is_validated_by_name(bad):
    with pytest.raises(ValueError, match=f"Received: save_freq={bad!r}"):
        policy.schedule_from_arguments(bad, 0.02, None)


def test_continuous_saves_whenever_the_last_backup_is_committed():
    schedule = policy.schedule_from_arguments("continuous", 0.02, None)
    schedule.start(0.0)
    # A write takes three batches: a save at every fourth batch end.
    writing_until = -1
    saved = []
    for batch in range(12):
        if schedule.on_batch_end(1, float(batch), writing=batch <= writing_until):
            saved.append(batch)
            schedule.saved(float(batch))
            writing_until = batch + 3
    assert saved == [0, 4, 8]
    assert not schedule.on_epoch_end(12.0)


@pytest.mark.parametrize("save_freq", ["auto", "continuous"])
def test_clock_driven_schedules_are_refused_with_several_workers(save_freq):
    schedule = policy.schedule_from_arguments(save_freq, 0.02, None)
    policy.check_same_step_on_every_worker(schedule, 1, save_freq, None)
    with pytest.raises(ValueError, match=f"save_freq={save_freq!r}"):
        policy.check_same_step_on_every_worker(schedule, 2, save_freq, None)
