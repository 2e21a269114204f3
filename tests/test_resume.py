"""A resumed fit(): skipped steps consume data but never run the model, and
the resumed epoch trains from the state the uninterrupted run had there."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from conftest import STEPS_PER_EPOCH, CrashAt, iterations, make_model, weights_of

import keras_ft
from keras_ft.training.resume import FastForward


class SkipFirst(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.done_at = None
        self.first_batch = None

    def on_train_begin(self, logs=None):
        self.fast_forward = FastForward(
            self.model,
            self.steps,
            {"loss": 123.0},
            on_done=lambda: setattr(self, "done_at", iterations(self.model)),
            on_first_batch=lambda batch: setattr(self, "first_batch", batch),
        )

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        skipped = self.epoch == 0 and batch < self.steps
        assert (logs["loss"] == 123.0) == skipped


def test_skipped_steps_train_nothing_and_the_rest_trains(data):
    model = make_model()
    before = weights_of(model)
    skipper = SkipFirst(STEPS_PER_EPOCH)
    model.fit(*data, epochs=1, batch_size=16, verbose=0, callbacks=[skipper])
    assert skipper.done_at == 0 and iterations(model) == 0
    for a, b in zip(before, weights_of(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not skipper.fast_forward.active

    skipper = SkipFirst(2)
    model.fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=[skipper])
    assert skipper.done_at == 0
    assert iterations(model) == 2 * STEPS_PER_EPOCH - 2
    if keras.backend.backend() != "torch":
        assert skipper.first_batch is not None


def test_remove_restores_the_real_train_function(data):
    model = make_model()
    model.make_train_function()
    real = model.train_function
    fast_forward = FastForward(model, 3, {}, on_done=lambda: None)
    assert fast_forward.active and model.train_function != real
    fast_forward.remove()
    assert model.train_function is real


class ResetRnnStates(keras.callbacks.Callback):
    """What users of stateful RNN layers add: each epoch starts afresh."""

    def on_epoch_begin(self, epoch, logs=None):
        self.model.layers[0].reset_state()


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="Keras carries a stateful RNN's states through fit() on TensorFlow "
    "only (JAX's compiled step leaves them at zeros; PyTorch's cannot train)",
)
def test_a_resumed_epoch_starts_from_the_rnn_states_of_the_save(tmp_path):
    """Set back at train begin, and again after the epoch's callbacks reset
    them: where its first batch trains, as in the uninterrupted run."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 5, 3)).astype("float32")
    y = x[:, -1, :1] * 2

    def fit(backup_dir, *crash):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input(batch_shape=(8, 5, 3)),
            keras.layers.LSTM(4, stateful=True),
            keras.layers.Dense(1),
        ])  # fmt: skip
        model.compile(keras.optimizers.Adam(0.01), "mse")
        backup = keras_ft.BackupAndRestore(str(backup_dir), save_freq=3)
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                  callbacks=[backup, ResetRnnStates(), *crash])  # fmt: skip
        return model

    reference = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "resumed", CrashAt())
    resumed = fit(tmp_path / "resumed")
    for a, b in zip(weights_of(reference), weights_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


class Subclassed(keras.Model):
    """No `build()` of its own: on TensorFlow, fit() builds it inside its
    first step, after the callbacks' train begin."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.dropout = keras.layers.Dropout(0.2)
        self.out = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.out(self.dropout(self.hidden(x), training=training))


def test_a_subclassed_model_built_by_its_first_step_resumes_exact(tmp_path, data):
    def fit(backup_dir, *crash):
        keras.utils.set_random_seed(3)
        model = Subclassed()
        model.compile(keras.optimizers.Adam(0.01), "mse")
        backup = keras_ft.BackupAndRestore(str(backup_dir), save_freq=3)
        model.fit(*data, batch_size=8, epochs=3, verbose=0,
                  callbacks=[backup, *crash])  # fmt: skip
        return model

    reference = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "resumed", CrashAt())
    with warnings.catch_warnings():  # Its build_config cannot be checked.
        warnings.simplefilter("ignore", UserWarning)
        resumed = fit(tmp_path / "resumed")
    for a, b in zip(weights_of(reference), weights_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def _optimizer(kind: str) -> keras.optimizers.Optimizer:
    if kind == "accumulating":  # Killed between two of its updates.
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)
    # Its scale grows every 3 finite steps: the save holds it mid-count.
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), dynamic_growth_steps=3
    )


@pytest.mark.parametrize("kind", ["accumulating", "loss scaled"])
def test_optimizer_counters_and_layers_drawing_noise_resume_exact(tmp_path, data, kind):
    """An optimizer that carries state between its updates, and layers that
    draw noise or keep statistics (each with a seed generator or moving
    averages of its own), resumed 5 batches into epoch 1 (a save every 2):
    the weights, the optimizer's variables and the logs end as if never
    stopped."""

    def fit(backup_dir, *crash):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.GaussianNoise(0.2),
            keras.layers.Reshape((2, 2, 1)),
            keras.layers.RandomFlip(),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.AlphaDropout(0.1),
            keras.layers.Dense(1),
        ])  # fmt: skip
        model.compile(_optimizer(kind), "mse", metrics=["mae"])
        backup = keras_ft.BackupAndRestore(str(backup_dir), save_freq=2)
        history = model.fit(*data, batch_size=8, epochs=3, verbose=0,
                            callbacks=[backup, *crash])  # fmt: skip
        return model, history.history

    reference, expected = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "resumed", CrashAt())
    resumed, history = fit(tmp_path / "resumed")
    assert history == expected
    assert iterations(resumed) == iterations(reference) > 0
    for a, b in zip(_state_of(reference), _state_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def _state_of(model: keras.Model) -> list[np.ndarray]:
    optimizer = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    return weights_of(model) + optimizer
