"""Whether an epoch's end backs up, as one pure function of what it knows.

`BackupAndRestore.on_epoch_end` gathers the facts (`EpochEnd`), asks the save
schedules only where `EpochEnd.asks_schedules` says they are asked (they count
epochs), and acts on `decide()`'s `Decision`; `tests/test_epoch_end.py` holds
the whole decision as a table.
"""

from __future__ import annotations

import dataclasses
import enum


class Stop(enum.Enum):
    """Whether a `BackupService` (StopAtStep, NanGuard, ...) stopped training."""

    NONE = "none"
    BACKED_UP = "backed up"  # Its stop is backed up where it stopped.
    DIVERGED = "diverged"  # The last good backup stays; nothing newer.

    @classmethod
    def of(cls, stopper: object | None) -> Stop:
        """The stop of the service `stopper` (`services.stopped_by()`)."""
        if stopper is None:
            return cls.NONE
        return cls.BACKED_UP if stopper.backs_up_stop else cls.DIVERGED


class Action(enum.Enum):
    NOTHING = "nothing"
    SAVE = "save"  # The epoch, whole: `(epoch, None)`.
    SAVE_STOPPED = "save stopped"  # The epoch where it stopped: `(epoch, done)`.


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """What an epoch's end knows.

    Attributes:
        preempted: A signal's backup already holds the exact step.
        skipped: A resume skipped this whole epoch (the backup holds it).
        steps: The batches an epoch has (Keras' `params["steps"]`), if known.
        done: The batches this epoch ran (those a resume skipped included).
        ran_out: The input ran out before `steps` (read with
            `steps_per_epoch`): Keras ends the epoch there, whole, and reads
            the input from its start in the next one.
        skip_until: The batches of it a resume skipped.
        stop: Whether, and how, a service stopped training.
        saves_stopped_epochs: Whether an epoch another callback stopped
            mid-way is backed up (not with `save_freq=False`).
        last_saved: `(epoch, batch)` of the last save started, or `None`.
        epoch: This epoch (0-based).
        scheduled: The schedule asks for a save (to the bucket, if any).
        scheduled_locally: The local tier's schedule asks for one.
        later_stateful: Callbacks after this one keep state their own
            epoch end changes.
    """

    epoch: int
    done: int
    steps: int | None = None
    ran_out: bool = False
    preempted: bool = False
    skipped: bool = False
    skip_until: int = 0
    stop: Stop = Stop.NONE
    saves_stopped_epochs: bool = True
    last_saved: tuple[int, int | None] | None = None
    scheduled: bool = False
    scheduled_locally: bool = False
    later_stateful: bool = False

    @property
    def stopped_mid_epoch(self) -> bool:
        return bool(self.steps) and self.done < self.steps and not self.ran_out

    @property
    def asks_schedules(self) -> bool:
        """Whether the schedules are asked (they count the epochs they see):
        at an epoch that ran whole in this process, unpreempted."""
        return not (self.preempted or self.skipped or self.stopped_mid_epoch)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What an epoch's end does.

    Attributes:
        action: Whether to back up, and which point.
        to_bucket: The save goes to the bucket too, not the local tier alone.
        again_after_all: Once every callback's epoch end ran, the save is
            taken again (it replaces this one), if this one was taken.
        completed: The epoch counts as run (for deleting the backup at the
            end of a fit() that ran every epoch).
    """

    action: Action = Action.NOTHING
    to_bucket: bool = False
    again_after_all: bool = False
    completed: bool = False


def decide(end: EpochEnd) -> Decision:
    """Whether, and what, the epoch's end `end` backs up."""
    if end.preempted or end.skipped:
        return Decision()  # Backed up at the exact step already, or skipped.
    if end.stopped_mid_epoch:  # Another callback stopped it at `done`.
        saved_stop = end.stop is Stop.BACKED_UP
        wanted = end.saves_stopped_epochs or saved_stop
        fresh = end.done > end.skip_until and end.last_saved != (end.epoch, end.done)
        if wanted and end.stop is not Stop.DIVERGED and fresh:
            return Decision(Action.SAVE_STOPPED, to_bucket=True)
        return Decision()
    # Run, whether or not its state is backed up: a fit() that ran every
    # epoch is over, diverged or not.
    to_bucket = end.scheduled or end.stop is Stop.BACKED_UP
    if not to_bucket and not end.scheduled_locally:
        return Decision(completed=True)
    return Decision(Action.SAVE, to_bucket, end.later_stateful, completed=True)
