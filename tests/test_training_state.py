"""TrainingState: what is saved, and applying it back to a model."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import iterations, make_model, weights_of

import keras_ft
from keras_ft.errors import CorruptCheckpointError
from keras_ft.saves.save import write_snapshot
from keras_ft.state import TrainingState


def trained_state(tmp_path, data, units=8):
    model = make_model(units)
    model.fit(*data, epochs=2, batch_size=16, verbose=0)
    snapshot = TrainingState(model).snapshot(2, 0)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_snapshot(snapshot, str(directory))
    return model, str(directory), snapshot.metadata


def test_metadata_records_counters_step_and_every_variable(tmp_path, data):
    model, _, metadata = trained_state(tmp_path, data)
    assert metadata["epochs_completed"] == 2
    assert metadata["batches_completed"] == 0
    assert metadata["step"] == iterations(model) == 8
    groups = [v[0] for v in metadata["variables"]]
    assert groups.count("model") == len(model.weights)
    assert groups.count("optimizer") == len(model.optimizer.variables)
    assert metadata["backend"] == keras.backend.backend()


def test_apply_restores_weights_and_optimizer_iterations(tmp_path, data):
    model, directory, metadata = trained_state(tmp_path, data)
    fresh = make_model()
    resume = TrainingState(fresh).apply(directory, metadata)
    assert (resume.epoch, resume.batch, resume.step) == (2, 0, 8)
    assert iterations(fresh) == 8
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.optimizer.variables, fresh.optimizer.variables, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        )


def test_apply_builds_an_unbuilt_model_from_the_recorded_input_shape(tmp_path, data):
    model, directory, metadata = trained_state(tmp_path, data)
    fresh = make_model(built=False)
    assert not fresh.built
    TrainingState(fresh).apply(directory, metadata)
    assert fresh.built and fresh.optimizer.built
    np.testing.assert_array_equal(weights_of(model)[0], weights_of(fresh)[0])


class Subclassed(keras.Model):
    """No `build()` of its own: Keras builds it at its first call (on
    TensorFlow, inside fit()'s first step, after the callbacks' train begin)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def test_apply_builds_an_unbuilt_subclassed_model(tmp_path, data):
    model = Subclassed()
    model.compile("adam", "mse")
    model.fit(*data, epochs=1, batch_size=16, verbose=0)
    snapshot = TrainingState(model).snapshot(1, 0)
    write_snapshot(snapshot, str(tmp_path))
    fresh = Subclassed()
    fresh.compile("adam", "mse")
    assert not fresh.built
    with pytest.warns(UserWarning, match="cannot be copied from its config"):
        TrainingState(fresh).apply(str(tmp_path), snapshot.metadata)
    assert fresh.built
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_shape_mismatch_names_the_variable_and_both_shapes(tmp_path, data):
    _, directory, metadata = trained_state(tmp_path, data, units=8)
    other = make_model(units=16)
    with pytest.raises(ValueError) as info:
        TrainingState(other).apply(directory, metadata)
    message = str(info.value)
    assert "kernel" in message and "(4, 16)" in message and "(4, 8)" in message
    # The model was configured otherwise: said as that, with the way out.
    assert isinstance(info.value, keras_ft.ConfigurationChangedError)
    assert "units: 8 in the backup, 16 now" in message
    assert "do not fit this configuration" in message


def test_another_optimizer_whose_variables_do_not_fit_is_a_configuration_change(
    tmp_path, data
):
    """Even where a changed configuration is continued (`on_config_change=
    "warn"`), one whose variables cannot be loaded is refused as what it is."""
    _, directory, metadata = trained_state(tmp_path, data)
    other = make_model()
    other.compile(keras.optimizers.SGD(momentum=0.9), "mse")
    with pytest.raises(keras_ft.ConfigurationChangedError) as info:
        TrainingState(other).apply(directory, metadata)
    message = str(info.value)
    assert "optimizer.class: 'Adam' in the backup, 'SGD' now" in message
    assert "momentum" in message and "use another `backup_dir`" in message


def test_a_dtype_mismatch_is_refused_not_cast(tmp_path, data):
    """A backup whose variable was float16 is not cast into a float32 model."""
    _, directory, metadata = trained_state(tmp_path, data)
    metadata["variables"][0][3] = "float16"
    fresh = make_model()
    before = weights_of(fresh)
    with pytest.raises(ValueError, match="is float32, but the backup's .* is float16"):
        TrainingState(fresh).apply(directory, metadata)
    for got, want in zip(weights_of(fresh), before, strict=True):
        np.testing.assert_array_equal(got, want)  # Nothing was assigned.


def test_optimizer_mismatch_is_reported(tmp_path, data):
    _, directory, metadata = trained_state(tmp_path, data)
    other = make_model()
    other.compile(keras.optimizers.SGD(), loss="mse")
    with pytest.raises(ValueError, match="optimizer variables"):
        TrainingState(other).apply(directory, metadata)


@pytest.mark.parametrize(
    "key, value",
    [
        ("epochs_completed", -1),
        ("step", "8"),
        ("variables", [["model", "x", ["a"], "float32"]]),
        ("variables", [["model", "x", [1], 32]]),
        ("state_format", 99),
    ],
)
def test_malformed_metadata_is_refused(tmp_path, data, key, value):
    """As a damaged checkpoint: a restore falls back to the one before."""
    _, directory, metadata = trained_state(tmp_path, data)
    metadata[key] = value
    with pytest.raises(CorruptCheckpointError, match=f"bad {key}"):
        TrainingState(make_model()).apply(directory, metadata)


def stateful_model(batch_size: int = 4) -> keras.Model:
    """Stateful RNN layers where a walk of the model must look for them: in
    a nested model, and inside `Bidirectional`."""
    inner = keras.Sequential(
        [keras.Input(batch_shape=(batch_size, 5, 3)), keras.layers.LSTM(
            6, stateful=True, return_sequences=True)]
    )  # fmt: skip
    inputs = keras.Input(batch_shape=(batch_size, 5, 3))
    outputs = keras.layers.Bidirectional(keras.layers.GRU(2, stateful=True))(
        inner(inputs)
    )
    model = keras.Model(inputs, keras.layers.Dense(1)(outputs))
    model.compile("adam", "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def rnn_states(model: keras.Model) -> list[np.ndarray]:
    layers = [model.layers[1].layers[0], model.layers[2].forward_layer,
              model.layers[2].backward_layer]  # fmt: skip
    return [keras.ops.convert_to_numpy(s) for layer in layers for s in layer.states]


def test_the_states_of_stateful_rnn_layers_are_saved_and_set_back(tmp_path):
    """Keras keeps them out of `model.variables` and saves none of them."""
    model = stateful_model()
    rng = np.random.default_rng(0)
    expected = [rng.normal(size=s.shape).astype("float32") for s in rnn_states(model)]
    assert [s.shape for s in expected] == [(4, 6), (4, 6), (4, 2), (4, 2)]
    layers = [model.layers[1].layers[0], model.layers[2].forward_layer,
              model.layers[2].backward_layer]  # fmt: skip
    values = iter(expected)
    for layer in layers:
        for state in layer.states:
            state.assign(next(values))
    snapshot = TrainingState(model).snapshot(1, 3)
    write_snapshot(snapshot, str(tmp_path))
    fresh = stateful_model()
    assert not any(s.any() for s in rnn_states(fresh))
    TrainingState(fresh).apply(str(tmp_path), snapshot.metadata)
    for got, want in zip(rnn_states(fresh), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_rnn_states_of_another_batch_size_start_from_zeros_and_say_so(tmp_path):
    """A rerun with another batch size is no damage: the rest is restored."""
    model = stateful_model(batch_size=4)
    for layer in model.layers[1].layers:
        layer.states[0].assign(np.ones((4, 6), "float32"))
    snapshot = TrainingState(model).snapshot(1, 0)
    write_snapshot(snapshot, str(tmp_path))
    fresh = stateful_model(batch_size=2)
    with pytest.warns(UserWarning, match=r"stateful RNN .*\(4, 6\).*\(2, 6\)"):
        TrainingState(fresh).apply(str(tmp_path), snapshot.metadata)
    assert not any(s.any() for s in rnn_states(fresh))
    np.testing.assert_array_equal(weights_of(fresh)[0], weights_of(model)[0])


class GAN(keras.Model):
    """Keras' guide's GAN: `train_step()` steps two optimizers kept in
    attributes, and the model itself is never called, so never built (on
    TensorFlow: PyTorch's trainer asks its users to say it is)."""

    def __init__(self):
        super().__init__()
        self.d = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                   keras.layers.Dense(1)])  # fmt: skip
        self.g = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
        self.seed_generator = keras.random.SeedGenerator(7)
        self.loss_tracker = keras.metrics.Mean(name="d_loss")
        self.built = keras.backend.backend() == "torch"

    def compile(self):
        super().compile()  # Its default optimizer is never built.
        self.d_optimizer = keras.optimizers.Adam(0.01)
        self.g_optimizer = keras.optimizers.Adam(0.01)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, real):
        n = keras.ops.shape(real)[0]
        noise = keras.random.normal((n, 2), seed=self.seed_generator)
        both = keras.ops.concatenate([self.g(noise), real])
        labels = keras.ops.concatenate(
            [keras.ops.ones((n, 1)), keras.ops.zeros((n, 1))]
        )
        d_loss = self._step(self.d, self.d_optimizer, labels, lambda: self.d(both))
        noise = keras.random.normal((n, 2), seed=self.seed_generator)
        fooled = keras.ops.zeros((n, 1))
        self._step(self.g, self.g_optimizer, fooled, lambda: self.d(self.g(noise)))
        self.loss_tracker.update_state(d_loss)
        return {"d_loss": self.loss_tracker.result()}

    def _step(self, trained, optimizer, labels, predict):
        variables = trained.trainable_weights
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self.loss_fn(labels, predict())
            grads = tape.gradient(loss, variables)
        else:  # PyTorch's autograd.
            self.zero_grad()
            loss = self.loss_fn(labels, predict())
            loss.backward()
            grads = [v.value.grad for v in variables]
        optimizer.apply(grads, variables)
        return loss


@pytest.mark.skipif(
    keras.backend.backend() == "jax",
    reason="Keras' JAX trainer carries the state of the compiled optimizer only",
)
def test_a_model_stepping_optimizers_of_its_own_resumes_exact(tmp_path, data):
    """A GAN resumed 5 batches into epoch 1 (a save every 2): the backup
    builds its two optimizers before loading them, and the weights and both
    optimizers' variables end as if never stopped (it could not be restored:
    the model is not built)."""
    from conftest import CrashAt

    def fit(backup_dir, *crash):
        keras.utils.set_random_seed(3)
        gan = GAN()
        gan.compile()
        backup = keras_ft.BackupAndRestore(str(backup_dir), save_freq=2)
        gan.fit(data[0], batch_size=8, epochs=3, verbose=0,
                callbacks=[backup, *crash])  # fmt: skip
        optimizers = gan.d_optimizer.variables + gan.g_optimizer.variables
        return weights_of(gan) + [keras.ops.convert_to_numpy(v) for v in optimizers]

    expected = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "resumed", CrashAt())
    found = fit(tmp_path / "resumed")
    assert len(found) == len(expected) == 6 + (2 + 2 * 4) + (2 + 2 * 2)
    for a, b in zip(expected, found, strict=True):
        np.testing.assert_array_equal(a, b)
