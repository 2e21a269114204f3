"""Batch ends handled at the next batch's begin, where Keras calls them on a
thread of its own (`keras_ft/training/batch_ends.py`)."""

from __future__ import annotations

import copy
import threading

import keras
import numpy as np
from conftest import iterations, make_data, make_model

import keras_ft
from keras_ft.training.batch_ends import BatchEnds, deferrable


def test_keras_may_call_the_batch_end_off_the_training_thread(backup_dir):
    callback = keras_ft.BackupAndRestore(backup_dir)
    assert callback.async_safe is deferrable()
    # TensorFlow's Keras never does (its backend is not thread-safe).
    assert deferrable() is (keras.backend.backend() in ("jax", "torch"))


def test_a_call_is_here_outside_fit_and_on_the_thread_that_started():
    ends = BatchEnds()
    assert ends.here()  # Outside fit(): whoever calls handles it.
    ends.start()
    assert ends.here()
    seen = []
    other = threading.Thread(target=lambda: seen.append(ends.here()))
    other.start()
    other.join()
    assert seen == [False]


def test_the_last_noted_batch_end_is_unhandled_until_handled():
    ends = BatchEnds()
    ends.start()
    assert ends.unhandled(0) is None
    ends.note(3, {"loss": 0.5})
    ends.note(2, {"loss": 0.75})  # Keras' pool ran batch 2's end last.
    assert ends.unhandled(2) == (3, {"loss": 0.5})
    assert ends.unhandled(3) is None
    ends.epoch_begin()  # Each epoch counts its batches from 0.
    assert ends.unhandled(0) is None


def test_logs_are_the_noted_ones_or_else_the_models_metrics():
    model = make_model()
    x, y = make_data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ends = BatchEnds()
    ends.start()
    ends.note(2, {"loss": 0.25})
    assert ends.logs(2, model, None) == {"loss": 0.25}
    # Not noted yet for batch 3: the metrics after it, as numbers.
    logs = ends.logs(3, model, None)
    assert set(logs) == {"loss"}
    assert isinstance(logs["loss"], float)
    expected = keras.ops.convert_to_numpy(model.get_metrics_result()["loss"])
    assert logs["loss"] == float(expected)


class StopAtBatchBegin(keras.callbacks.Callback):
    async_safe = True

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True  # After the step that begins now.


def test_an_epoch_stopped_by_another_callback_is_backed_up_where_it_stopped(
    backup_dir,
):
    # The stop's last batch is handled at the epoch's end, where its batch
    # end ran on Keras' thread (JAX, PyTorch).
    model = make_model()
    callback = keras_ft.BackupAndRestore(
        backup_dir, save_freq=100, delete_checkpoint=False
    )
    model.fit(
        *make_data(), batch_size=8, epochs=3, verbose=0,
        callbacks=[callback, StopAtBatchBegin(3)],
    )  # fmt: skip
    assert iterations(model) == 4
    restored = make_model()
    point = keras_ft.WorkerTrainingState(restored, backup_dir).restore()
    assert (point.epoch, point.batch, point.step) == (0, 4, 4)
    backed_up = restored.get_weights()
    for ours, theirs in zip(model.get_weights(), backed_up, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_deep_copy_notes_nothing_and_has_its_own_lock():
    # Keras Tuner deep-copies the callbacks of each trial.
    ends = BatchEnds()
    ends.start()
    ends.note(2, {"loss": 1.0})
    copied = copy.deepcopy(ends)
    assert copied.unhandled(0) is None
    copied.note(1, None)
    assert ends.unhandled(0) == (2, {"loss": 1.0})
