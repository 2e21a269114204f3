"""StepRate: steps per second and backup time, in what other callbacks log."""

from __future__ import annotations

import copy as copy_module
import csv
import glob
import os
import threading

import keras
import pytest
from conftest import STEPS_PER_EPOCH, make_model

import keras_ft


def test_csv_logger_records_the_rate_and_backup_time(backup_dir, data, tmp_path):
    x, y = data
    log = str(tmp_path / "log.csv")
    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs))

    callback = keras_ft.BackupAndRestore(backup_dir, save_freq=2, async_save=False)
    history = make_model().fit(
        x, y, epochs=3, batch_size=16, verbose=0,
        callbacks=[callback, keras_ft.StepRate(), keras.callbacks.CSVLogger(log),
                   Look()],
    )  # fmt: skip
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert all(float(r["steps_per_second"]) > 0 for r in rows)
    assert all(float(r["backup_seconds"]) > 0 for r in rows)  # 2 saves an epoch.
    assert history.history["steps_per_second"] == [
        pytest.approx(float(r["steps_per_second"])) for r in rows
    ]
    # Batch logs: a rate at every batch; backup time only where a save ran.
    assert len(seen) == 3 * STEPS_PER_EPOCH
    assert all(s["steps_per_second"] > 0 for s in seen)
    saved = [s["backup_seconds"] > 0 for s in seen]
    assert saved == [False, True] * (3 * STEPS_PER_EPOCH // 2)
    # Sync saves hold training up: the sum is what the callback measured.
    total = sum(float(r["backup_seconds"]) for r in rows)
    assert total == pytest.approx(callback.backup_seconds, rel=1e-6)


@pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="TensorFlow's Keras calls every batch end on the training thread",
)
def test_batch_ends_run_off_the_training_thread_and_count_every_step(backup_dir, data):
    x, y = data
    training = threading.get_ident()
    seen = []

    class Look(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_end(self, batch, logs=None):
            seen.append((threading.get_ident(), batch, dict(logs)))

    backup = keras_ft.BackupAndRestore(backup_dir, save_freq=2, verbose=0)
    rate = keras_ft.StepRate()
    history = make_model().fit(
        x, y, epochs=3, batch_size=16, verbose=0,
        callbacks=[backup, rate, Look()],
    )  # fmt: skip
    # Keras no longer waits for each step before the batch ends.
    assert len(seen) == 3 * STEPS_PER_EPOCH
    assert all(thread != training for thread, _, _ in seen)
    # Each batch end's rate, unless Keras' pool ran it after a later one's
    # (often: the pool's threads wait for the steps' logs side by side); the
    # epoch's first to arrive always has one.
    rated = [
        logs["steps_per_second"] for *_, logs in seen if "steps_per_second" in logs
    ]
    assert len(rated) >= 3 and all(r > 0 for r in rated)
    # Every step counted once in the epochs' rates; every save's time in them.
    assert len(history.history["steps_per_second"]) == 3
    assert all(r > 0 for r in history.history["steps_per_second"])
    assert sum(history.history["backup_seconds"]) > 0
    assert rate._steps == 3 * STEPS_PER_EPOCH


def test_a_batch_end_after_a_later_ones_adds_nothing():
    rate = keras_ft.StepRate()
    rate.on_train_begin()
    rate.on_epoch_begin(0)
    later, earlier = {"loss": 1.0}, {"loss": 2.0}
    rate.on_train_batch_end(5, later)
    rate.on_train_batch_end(4, earlier)
    assert "steps_per_second" in later and earlier == {"loss": 2.0}
    rate.on_train_batch_end(6, {})
    logs = {}
    rate.on_epoch_end(0, logs)
    assert rate._steps == 7 and logs["steps_per_second"] > 0
    # Keras Tuner deep-copies callbacks: the copy is fresh and safe to use.
    copy = copy_module.deepcopy(rate)
    assert copy.async_safe and copy is not rate


def test_without_a_backup_the_backup_time_is_zero(data):
    x, y = data
    history = make_model().fit(
        x, y, epochs=2, batch_size=16, verbose=0, callbacks=[keras_ft.StepRate()]
    )
    assert history.history["backup_seconds"] == [0.0, 0.0]
    assert all(r > 0 for r in history.history["steps_per_second"])


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorBoard writes through TensorFlow on every backend; once is enough",
)
def test_tensorboard_writes_the_rate(backup_dir, data, tmp_path):
    import tensorflow as tf

    x, y = data
    logdir = str(tmp_path / "tb")
    make_model().fit(
        x, y, epochs=2, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), keras_ft.StepRate(),
                   keras.callbacks.TensorBoard(logdir, update_freq=1)],
    )  # fmt: skip
    tags = set()
    for path in glob.glob(os.path.join(logdir, "train", "events.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(v.tag for v in event.summary.value)
    assert {"epoch_steps_per_second", "epoch_backup_seconds"} <= tags
    assert {"batch_steps_per_second", "batch_backup_seconds"} <= tags
