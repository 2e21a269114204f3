"""A backup written by a training configured otherwise is never continued
silently: a warning names what differs, or the restore refuses it."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from conftest import make_data, tree_digest, weights_of

import keras_ft
from keras_ft.state import configuration


def compiled(units=8, learning_rate=1e-2, loss="mse", activation="relu"):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(units, activation=activation),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(learning_rate), loss=loss)
    return model


def backed_up(tmp_path, model):
    x, y = make_data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    keras_ft.WorkerTrainingState(model, str(tmp_path)).back_up(0)


def restore(tmp_path, model, **kwargs):
    model.optimizer.build(model.trainable_variables)
    state = keras_ft.WorkerTrainingState(model, str(tmp_path), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = state.restore()
    return point, [str(w.message) for w in caught if "configured" in str(w.message)]


def test_the_same_configuration_built_again_restores_without_a_word(tmp_path):
    backed_up(tmp_path, compiled())
    # Built twice in one process: layers are numbered (dense_2), names differ.
    point, said = restore(tmp_path, compiled())
    assert point is not None and point.config_changes == []
    assert said == []


@pytest.mark.parametrize(
    "changed, named",
    [
        ({"learning_rate": 1e-3}, "optimizer.learning_rate: 0.01 in the backup"),
        ({"loss": "mae"}, "loss: 'mse' in the backup, 'mae' now"),
        ({"activation": "tanh"}, "activation: 'relu' in the backup, 'tanh' now"),
    ],
)
def test_a_changed_configuration_is_restored_with_a_warning(tmp_path, changed, named):
    backed_up(tmp_path, compiled())
    point, said = restore(tmp_path, compiled(**changed))
    assert point is not None  # Continued, as `on_config_change="warn"` says.
    assert len(said) == 1 and named in said[0], said
    assert any(named in change for change in point.config_changes)


def test_raise_refuses_before_loading_anything(tmp_path):
    backed_up(tmp_path, compiled())
    before = tree_digest(str(tmp_path))
    model = compiled(learning_rate=1e-3)
    model.optimizer.build(model.trainable_variables)
    weights = weights_of(model)
    state = keras_ft.WorkerTrainingState(model, str(tmp_path), on_config_change="raise")
    with pytest.raises(keras_ft.ConfigurationChangedError, match="learning_rate"):
        state.restore()
    for now, then in zip(weights_of(model), weights, strict=True):
        np.testing.assert_array_equal(now, then)
    assert tree_digest(str(tmp_path)) == before


def test_a_learning_rate_a_callback_lowered_is_not_a_change(tmp_path):
    """The configuration is the one the training started with: a rate
    ReduceLROnPlateau lowered is state, restored with the optimizer."""
    model = compiled()
    state = keras_ft.WorkerTrainingState(model, str(tmp_path))
    assert state.restore() is None  # As fit() starts: nothing to resume.
    x, y = make_data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.optimizer.learning_rate.assign(1e-4)
    state.back_up(0)
    model = compiled()
    point, said = restore(tmp_path, model)
    assert said == [] and point.config_changes == []
    # The lowered rate is state: restored with the optimizer's variables.
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == (
        pytest.approx(1e-4)
    )


def test_the_callback_refuses_with_raise(tmp_path, capsys):
    x, y = make_data()
    first = keras_ft.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    compiled().fit(x, y, epochs=1, verbose=0, callbacks=[first])
    before = tree_digest(str(tmp_path))
    callback = keras_ft.BackupAndRestore(str(tmp_path), on_config_change="raise")
    with pytest.raises(keras_ft.ConfigurationChangedError, match="'tanh' now"):
        compiled(activation="tanh").fit(x, y, epochs=2, verbose=0, callbacks=[callback])
    assert tree_digest(str(tmp_path)) == before
    # The backup is not held: the same configuration resumes it.
    capsys.readouterr()
    again = keras_ft.BackupAndRestore(str(tmp_path), on_config_change="raise")
    compiled().fit(x, y, epochs=2, verbose=0, callbacks=[again])
    assert "resuming at epoch 2/2" in capsys.readouterr().out


def test_on_config_change_is_validated():
    with pytest.raises(ValueError, match="on_config_change='sometimes'"):
        keras_ft.BackupAndRestore("/tmp/unused", on_config_change="sometimes")


def test_only_keys_both_sides_have_are_compared():
    saved = {"optimizer": {"class": "Adam", "learning_rate": 0.01}, "model": None}
    newer = {
        "optimizer": {"class": "Adam", "learning_rate": 0.01, "new_argument": 1},
        "model": {"layers": []},
    }
    assert configuration.differences(saved, newer) == []
    assert configuration.differences("not a dict", newer) == []
