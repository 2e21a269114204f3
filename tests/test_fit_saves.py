"""`keras_ft/fit_saves.py`: one `fit()`'s saves, as `BackupAndRestore`
makes them: a diverged state skipped, a save waited for, a failed write
raised or warned about (`on_save_error`)."""

from __future__ import annotations

import errno
import fcntl
import os
import signal

import keras
import numpy as np
import pytest
from conftest import BATCH_SIZE, make_model, weights_of

import keras_ft
from keras_ft.errors import CheckpointWriteError

# The probe below keeps no state worth a backup: not said at each first save.
pytestmark = pytest.mark.filterwarnings("ignore:BackupAndRestore. the state of AtBatch")


class AtBatch(keras.callbacks.Callback):
    """Runs `act(saves, model)` once, at the end of batch `batch` of the
    first epoch, after the backup's own batch end."""

    def __init__(self, backup, batch, act):
        super().__init__()
        self.backup, self.batch, self.act = backup, batch, act
        self.result = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch and self.result is None:
            self.result = self.act(self.backup._saves, self.model)


def fit_with(backup_dir, act, batch=1, **kwargs):
    backup = keras_ft.BackupAndRestore(backup_dir, save_freq=False, **kwargs)
    probe = AtBatch(backup, batch, act)
    model = make_model()
    x = keras.random.normal((64, 4), seed=1)
    model.fit(x, x[:, :1], epochs=1, batch_size=BATCH_SIZE, verbose=0,
              callbacks=[backup, probe])  # fmt: skip
    return probe.result


def test_a_save_waited_for_says_where_it_went(backup_dir):
    said = fit_with(
        backup_dir,
        lambda saves, model: (
            saves.save_now(model, {"loss": 1.0}, 0, 2, held=True),
            saves.save_now(model, {"loss": 1.0}, 0, 2),
        ),
        delete_checkpoint=False,
    )
    assert said[0] == "the backup already holds epoch 1, batch 2"
    path = os.path.join(backup_dir, "chief", "ckpt-00000001")
    assert said[1] == f"backed up epoch 1, batch 2 to {path}"
    loaded = keras_ft.load_checkpoint(backup_dir, make_model())
    assert (loaded.epoch, loaded.batch) == (0, 2)


def test_a_diverged_loss_is_not_backed_up_and_the_next_finite_one_is(backup_dir):
    def act(saves, model):
        with pytest.warns(UserWarning, match="not backing up a diverged model"):
            skipped = saves.save(model, {"loss": float("nan")}, 0, 2)
        diverged = saves.skipped_non_finite
        saved = saves.save(model, {"loss": 0.5}, 0, 2)
        return skipped, diverged, saved, saves.skipped_non_finite, saves.last

    skipped, diverged, saved, after, last = fit_with(
        backup_dir, act, delete_checkpoint=False
    )
    assert not skipped and diverged == "the loss is nan at epoch 1, batch 2"
    assert saved and after is None and last == (0, 2)


def held(backup_dir: str) -> bool:
    """Whether some open file holds the backup's lock (a `flock` taken
    through another descriptor conflicts, in this process too)."""
    fd = os.open(os.path.join(backup_dir, "chief", ".lock"), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def failing_write():
    raise CheckpointWriteError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_warns_with_on_save_error_warn(backup_dir):
    def act(saves, model):
        with pytest.warns(UserWarning, match="No space left on device"):
            return saves.run(failing_write), held(backup_dir)

    result, still_locked = fit_with(backup_dir, act, on_save_error="warn")
    assert result is None and still_locked  # Training goes on, holding it.


def test_a_failed_write_ends_the_fit_and_lets_go_of_the_backup(backup_dir):
    before = []

    def act(saves, model):
        before.append(held(backup_dir))
        return saves.run(failing_write)

    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        fit_with(backup_dir, act)
    # Keras calls no on_train_end then: the lock was released on the way out.
    assert before == [True] and not held(backup_dir)


class SignalInValidation(keras.callbacks.Callback):
    """SIGTERM to this process at the third epoch's second validation batch."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_test_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (2, 1):
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_backup_taken_in_a_validation_gives_its_epoch_the_training_logs(
    tmp_path, data
):
    """A validation resets the metrics: a backup taken in one (a preemption)
    holds them as training left them, so the rerun's History reports that
    epoch's training loss as the uninterrupted run does (it reported the
    validation's half-run mean)."""
    x, y = data
    rng = np.random.default_rng(1)
    vx = rng.normal(size=(40, 4)).astype("float32")
    vy = vx.sum(axis=1, keepdims=True)

    def fit(backup_dir, *signal_at):
        keras.utils.set_random_seed(3)
        model = make_model()
        backup = keras_ft.BackupAndRestore(
            str(backup_dir), save_freq=2, verbose=0, exit_on_preemption=False
        )
        history = model.fit(
            x, y, batch_size=BATCH_SIZE, epochs=4, verbose=0,
            validation_data=(vx, vy), validation_batch_size=8,
            callbacks=[backup, *signal_at],
        ).history  # fmt: skip
        return history, weights_of(model), backup

    expected, weights, _ = fit(tmp_path / "reference")
    _, _, preempted = fit(tmp_path / "resumed", SignalInValidation())
    assert preempted.preempted_by == "SIGTERM"
    history, resumed, _ = fit(tmp_path / "resumed")
    assert history == expected
    for found, want in zip(resumed, weights, strict=True):
        np.testing.assert_array_equal(found, want)
