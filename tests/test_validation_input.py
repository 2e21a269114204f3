"""A Python generator as `validation_data` (`keras_ft/training/validation_input.py`):
a resumed fit() validates on the batches the uninterrupted one did."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import weights_of
from test_fit_saves import SignalInValidation

from keras_ft.training import resume
from keras_ft.training.validation_input import ValidationStream

# Keras reads a generator through tf.data's prefetch on TensorFlow, which draws
# an unknown number of batches ahead: a run validates differently each time.
IN_ORDER = pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="TensorFlow prefetches the validation generator: not reproducible",
)


class CrashAt(keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            raise RuntimeError("crash")


def validation_batches():
    """Batches in order, over and over: a generator that keeps its own place."""
    x = np.random.default_rng(5).normal(size=(40, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    while True:
        for start in range(0, 40, 8):
            yield x[start : start + 8], y[start : start + 8]


def fit(data, backup_dir, save_freq, *crash):
    """4 epochs validating 3 batches each; the learning rate follows
    `val_loss`, so the weights do too."""
    import keras_ft

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.05), "mse")
    callbacks = [
        keras_ft.BackupAndRestore(
            str(backup_dir), save_freq=save_freq, verbose=0, exit_on_preemption=False
        ),
        keras.callbacks.ReduceLROnPlateau("val_loss", factor=0.5, patience=0),
        *crash,
    ]
    history = model.fit(
        *data, batch_size=8, epochs=4, verbose=0, callbacks=callbacks,
        validation_data=validation_batches(), validation_steps=3,
    ).history  # fmt: skip
    return history, weights_of(model)


@IN_ORDER
@pytest.mark.parametrize(
    "save_freq, crash", [(2, (1, 5)), (2, (3, 3)), ("epoch", (2, 1))]
)
def test_a_resumed_fit_validates_on_the_batches_of_an_uninterrupted_one(
    tmp_path, data, save_freq, crash
):
    """Killed after one validation or three (each draws one batch past the
    two Keras draws ahead and yields again), the rerun's new generator is
    drawn to where the backup's was: `val_loss`, the learning rate it sets
    and the weights end as uninterrupted."""
    expected, weights = fit(data, tmp_path / "reference", save_freq)
    with pytest.raises(RuntimeError, match="crash"):
        fit(data, tmp_path / "resumed", save_freq, CrashAt(*crash))
    history, resumed = fit(data, tmp_path / "resumed", save_freq)
    assert history == expected
    for found, want in zip(resumed, weights, strict=True):
        np.testing.assert_array_equal(found, want)


@IN_ORDER
def test_a_backup_taken_in_a_validation_counts_the_draws_before_it(tmp_path, data):
    """Preempted in a validation, the backup counts what the validations
    before it drew: the rerun validates that epoch again from its start."""
    expected, weights = fit(data, tmp_path / "reference", 2)
    fit(data, tmp_path / "resumed", 2, SignalInValidation())
    history, resumed = fit(data, tmp_path / "resumed", 2)
    assert history == expected
    for found, want in zip(resumed, weights, strict=True):
        np.testing.assert_array_equal(found, want)


@IN_ORDER
def test_a_count_past_what_the_validations_could_draw_is_not_drawn(
    tmp_path, data, monkeypatch
):
    """A damaged count (a billion draws, two epochs of 3-batch validations
    in) is said, not drawn: the generator starts at its first batch."""
    expected, _ = fit(data, tmp_path / "reference", "epoch")
    with monkeypatch.context() as patch:
        patch.setattr(ValidationStream, "drawn", lambda self, *_: 10**9)
        with pytest.raises(RuntimeError, match="crash"):
            fit(data, tmp_path / "damaged", "epoch", CrashAt(2, 1))
    with pytest.warns(UserWarning, match="more than its validations could draw"):
        history, _ = fit(data, tmp_path / "damaged", "epoch")
    assert {k: v[:2] for k, v in history.items()} == {
        k: v[:2] for k, v in expected.items()
    }
    assert len(history["val_loss"]) == 4


def test_a_count_that_is_not_one_is_damage():
    for drawn in (-1, 2.5, "3", True):
        with pytest.raises(ValueError, match="validation_drawn"):
            resume.check_saved({"validation_drawn": drawn}, [])
    resume.check_saved({"validation_drawn": 7}, [])
