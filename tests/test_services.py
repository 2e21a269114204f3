"""A service callback's link to the `BackupAndRestore` of its `fit()`
(`keras_ft/training/services.py`), whichever order the callbacks are in.
The services themselves: `test_stops.py`, `test_nan_guard.py`,
`test_step_rate.py`."""

from __future__ import annotations

import keras
import pytest
from conftest import iterations, make_model

import keras_ft
from keras_ft.training.services import BackupService

# The test's callbacks keep no state worth backing up.
pytestmark = pytest.mark.filterwarnings("ignore:.*is not backed up")


class Recorder(BackupService):
    """Records what it sees of the backup, and when it is asked to correct
    an epoch's logs; stops at `stop_at` (a step) if given."""

    def __init__(self, events: list, stop_at: int | None = None):
        super().__init__()
        self.events, self.stop_at = events, stop_at
        self.seen: list = []

    def on_train_batch_begin(self, batch, logs=None):
        if not self.seen:  # Bound at the backup's train begin, in any order.
            self.seen.append(self.backup)

    def on_train_batch_end(self, batch, logs=None):
        if self.stop_at is not None and iterations(self.model) == self.stop_at:
            self._stop(f"step {self.stop_at}")

    def before_epoch_backup(self, logs):
        self.events.append("service")
        logs["corrected"] = 1.0

    def finished(self, step, saved_state):
        return "trained enough" if step >= 8 else None


class Saves(keras_ft.CheckpointListener):
    def __init__(self, events: list):
        self.events = events

    def before_save(self, epoch, step):
        self.events.append("save")


class Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen: list = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(dict(logs or {}))


@pytest.mark.parametrize("service_first", [True, False])
def test_the_service_corrects_each_epoch_before_its_backup(
    backup_dir, data, service_first
):
    events: list = []
    service = Recorder(events)
    backup = keras_ft.BackupAndRestore(
        backup_dir, listeners=[Saves(events)], delete_checkpoint=False, verbose=0
    )
    logs = Logs()
    callbacks = [service, backup, logs] if service_first else [backup, service, logs]
    make_model().fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=callbacks)
    assert events == ["service", "save"] * 2
    assert service.seen == [backup] and service.backup is None  # Taken back.
    assert [entry["corrected"] for entry in logs.seen] == [1.0, 1.0]


def test_without_a_backup_a_service_runs_alone(data):
    events: list = []
    service = Recorder(events, stop_at=3)
    model = make_model()
    model.fit(*data, epochs=3, batch_size=16, verbose=0, callbacks=[service])
    assert service.seen == [None] and events == []  # No backup to correct for.
    assert service.stopped == "step 3" and iterations(model) == 3


def test_a_stop_keeps_the_backup_at_its_step_and_a_finished_run_trains_nothing(
    backup_dir, data
):
    """Stopped by a service, the backup is kept (fit() did not finish) with
    the stopped step in it; a resumed fit() the service says is finished
    trains nothing."""
    model = make_model()
    model.fit(*data, epochs=4, batch_size=16, verbose=0,
              callbacks=[Recorder([], stop_at=8),
                         keras_ft.BackupAndRestore(backup_dir, verbose=0)])  # fmt: skip
    assert iterations(model) == 8
    restored = make_model()
    state = keras_ft.WorkerTrainingState(restored, backup_dir)
    with state.locked():
        assert state.restore().step == 8
    state.close()

    again = make_model()
    again.fit(*data, epochs=4, batch_size=16, verbose=0,
              callbacks=[Recorder([]),
                         keras_ft.BackupAndRestore(backup_dir, verbose=0)])  # fmt: skip
    assert iterations(again) == 8  # Restored, and not trained further.
