"""`keras_ft/fit_batches.py`: where a `fit()` is in its epoch, the batches
a resumed epoch skips, and the saves its batch ends start."""

from __future__ import annotations

import keras
import pytest
from conftest import BATCH_SIZE, STEPS_PER_EPOCH, make_data, make_model

import keras_ft
from keras_ft.checkpoint.store import open_store

pytestmark = pytest.mark.filterwarnings("ignore:BackupAndRestore. the state of")


class Positions(keras.callbacks.Callback):
    """After the backup in the list: what its batches say at each epoch's
    begin (batches to skip) and end (where the fit is)."""

    def __init__(self, backup, crash_at=None):
        super().__init__()
        self.backup, self.crash_at = backup, crash_at
        self.skips, self.ends = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.skips.append((epoch, self.backup._batches.skip_until))

    def on_train_batch_end(self, batch, logs=None):
        if (self.backup._batches.epoch, batch) == self.crash_at:
            raise RuntimeError("Crash!")

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(self.backup._batches.position())


def fit(backup_dir, crash_at=None, **kwargs) -> Positions:
    keras.utils.set_random_seed(0)
    backup = keras_ft.BackupAndRestore(backup_dir, **kwargs)
    positions = Positions(backup, crash_at)
    make_model().fit(*make_data(), epochs=3, batch_size=BATCH_SIZE, verbose=0,
                     shuffle=False, callbacks=[backup, positions])  # fmt: skip
    return positions


def test_every_epoch_ends_with_all_its_batches_handled(backup_dir):
    positions = fit(backup_dir, save_freq=2)
    assert positions.ends == [(e, STEPS_PER_EPOCH) for e in range(3)]
    assert positions.skips == [(0, 0), (1, 0), (2, 0)]


def test_a_resumed_epoch_skips_the_batches_its_backup_holds(backup_dir):
    with pytest.raises(RuntimeError, match="Crash!"):
        fit(backup_dir, crash_at=(1, 2), save_freq=1, delete_checkpoint=False)
    # The crashed fit's last save may still be committing: a training of
    # the directory waits for it when it locks.
    waits = keras_ft.WorkerTrainingState(make_model(), backup_dir)
    waits.lock()
    waits.close()
    store = open_store(f"{backup_dir}/chief")
    saved = store.unverified_metadata(store.checkpoints()[-1])
    assert saved["epochs_completed"] == 1 and 0 < saved["batches_completed"] <= 3
    resumed = fit(backup_dir, save_freq=1)
    # Only the interrupted epoch skips, as many batches as were backed up.
    assert resumed.skips == [(1, saved["batches_completed"]), (2, 0)]
    assert resumed.ends == [(1, STEPS_PER_EPOCH), (2, STEPS_PER_EPOCH)]
