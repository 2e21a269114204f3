"""The epoch-end decision as a table: what `decide()` does with each case."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import run_once_on

import keras_ft
from keras_ft.epoch_end import Action, Decision, EpochEnd, Stop, decide

ONCE = run_once_on("torch", "a pure function; the backend does not matter")

NOTHING, SAVE, STOPPED = Action.NOTHING, Action.SAVE, Action.SAVE_STOPPED
RAN = Decision(completed=True)  # Ran whole, nothing saved.

# A whole epoch of 10 batches, ended in this process, nothing asking a save.
WHOLE = EpochEnd(epoch=2, done=10, steps=10)
# Stopped by another callback at batch 4 of 10.
AT_4 = dataclasses.replace(WHOLE, done=4)

TABLE = [
    # (case, facts, decision)
    ("nothing scheduled", WHOLE, RAN),
    (
        "scheduled",
        dataclasses.replace(WHOLE, scheduled=True),
        Decision(SAVE, to_bucket=True, completed=True),
    ),
    (
        "scheduled, later callbacks keep state: saved again after them",
        dataclasses.replace(WHOLE, scheduled=True, later_stateful=True),
        Decision(SAVE, to_bucket=True, again_after_all=True, completed=True),
    ),
    (
        "the local tier's schedule alone: not to the bucket",
        dataclasses.replace(WHOLE, scheduled_locally=True),
        Decision(SAVE, to_bucket=False, completed=True),
    ),
    (
        "both schedules",
        dataclasses.replace(WHOLE, scheduled=True, scheduled_locally=True),
        Decision(SAVE, to_bucket=True, completed=True),
    ),
    (
        "a stop that asks for its backup (StopAtStep), unscheduled",
        dataclasses.replace(WHOLE, stop=Stop.BACKED_UP),
        Decision(SAVE, to_bucket=True, completed=True),
    ),
    (
        "diverged at the epoch's end (NanGuard): ran, saved only if scheduled",
        dataclasses.replace(WHOLE, stop=Stop.DIVERGED),
        RAN,
    ),
    (
        "diverged, scheduled: the save's own check refuses a non-finite state",
        dataclasses.replace(WHOLE, stop=Stop.DIVERGED, scheduled=True),
        Decision(SAVE, to_bucket=True, completed=True),
    ),
    (
        "an unknown number of steps: the epoch ran whole",
        dataclasses.replace(WHOLE, steps=None, scheduled=True),
        Decision(SAVE, to_bucket=True, completed=True),
    ),
    (
        "preempted: backed up at the signal",
        dataclasses.replace(WHOLE, preempted=True),
        Decision(),
    ),
    (
        "preempted, scheduled",
        dataclasses.replace(WHOLE, preempted=True, scheduled=True),
        Decision(),
    ),
    ("skipped by a resume", dataclasses.replace(WHOLE, skipped=True), Decision()),
    ("stopped mid-epoch by another callback", AT_4, Decision(STOPPED, to_bucket=True)),
    (
        "the input ran out at batch 4 of 10 (steps_per_epoch): the epoch ran",
        dataclasses.replace(AT_4, ran_out=True, scheduled=True),
        Decision(SAVE, to_bucket=True, completed=True),
    ),
    (
        "stopped mid-epoch, scheduled: the stop point, not the epoch",
        dataclasses.replace(AT_4, scheduled=True, later_stateful=True),
        Decision(STOPPED, to_bucket=True),
    ),
    (
        "stopped mid-epoch, only preemptions saved (save_freq=False)",
        dataclasses.replace(AT_4, saves_stopped_epochs=False),
        Decision(),
    ),
    (
        "stopped mid-epoch by a stop that asks for its backup, save_freq=False",
        dataclasses.replace(AT_4, saves_stopped_epochs=False, stop=Stop.BACKED_UP),
        Decision(STOPPED, to_bucket=True),
    ),
    (
        "stopped mid-epoch, diverged",
        dataclasses.replace(AT_4, stop=Stop.DIVERGED),
        Decision(),
    ),
    (
        "stopped mid-epoch where the last save already is",
        dataclasses.replace(AT_4, last_saved=(2, 4)),
        Decision(),
    ),
    (
        "stopped mid-epoch where the last save was an epoch earlier",
        dataclasses.replace(AT_4, last_saved=(1, 4)),
        Decision(STOPPED, to_bucket=True),
    ),
    (
        "stopped within the batches a resume skipped",
        dataclasses.replace(AT_4, skip_until=4),
        Decision(),
    ),
    (
        "stopped just past the batches a resume skipped",
        dataclasses.replace(AT_4, skip_until=3),
        Decision(STOPPED, to_bucket=True),
    ),
    (
        "stopped mid-epoch, preempted",
        dataclasses.replace(AT_4, preempted=True),
        Decision(),
    ),
]


@ONCE
@pytest.mark.parametrize(
    "facts, expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_the_decision_table(facts, expected):
    assert decide(facts) == expected


@ONCE
@pytest.mark.parametrize(
    "facts, asked",
    [
        (WHOLE, True),
        (dataclasses.replace(WHOLE, stop=Stop.DIVERGED), True),
        (dataclasses.replace(WHOLE, steps=None), True),
        (dataclasses.replace(WHOLE, preempted=True), False),
        (dataclasses.replace(WHOLE, skipped=True), False),
        (AT_4, False),
    ],
)
def test_the_schedules_are_asked_at_whole_epochs_this_process_ran(facts, asked):
    """They count the epochs they see: never one skipped, stopped or
    already backed up at a signal."""
    assert facts.asks_schedules is asked


@ONCE
def test_the_stop_of_a_service():
    assert Stop.of(None) is Stop.NONE
    assert Stop.of(keras_ft.StopAtStep(100)) is Stop.BACKED_UP
    assert Stop.of(keras_ft.NanGuard()) is Stop.DIVERGED
