"""Other callbacks' state: stock callbacks, the protocol, and the rest."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import CrashAt

from keras_ft.state import saved_state
from keras_ft.state.arrays import join, split
from keras_ft.training import callback_state


class Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def get_state(self):
        return {"seen": self.seen}

    def set_state(self, state):
        self.seen = state["seen"]


def test_stock_callbacks_round_trip():
    stopper = keras.callbacks.EarlyStopping(restore_best_weights=True)
    stopper.wait, stopper.best, stopper.best_epoch = 2, 0.25, 3
    stopper.best_weights = [np.ones((2, 2))]
    plateau = keras.callbacks.ReduceLROnPlateau()
    plateau.wait, plateau.best, plateau.cooldown_counter = 1, 0.5, 2
    history = keras.callbacks.History()
    history.epoch, history.history = [0, 1], {"loss": [1.0, 0.5]}
    states = callback_state.capture([stopper, plateau, history])
    assert set(states) == {"EarlyStopping:0", "ReduceLROnPlateau:0", "History:0"}

    fresh = [
        keras.callbacks.EarlyStopping(restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(),
        keras.callbacks.History(),
    ]
    for callback in fresh:
        callback.on_train_begin()  # What fit() does before we restore.
    callback_state.apply(fresh, states)
    assert (fresh[0].wait, fresh[0].best, fresh[0].best_epoch) == (2, 0.25, 3)
    np.testing.assert_array_equal(fresh[0].best_weights[0], np.ones((2, 2)))
    assert (fresh[1].wait, fresh[1].best, fresh[1].cooldown_counter) == (1, 0.5, 2)
    assert fresh[2].epoch == [0, 1] and fresh[2].history == {"loss": [1.0, 0.5]}


def test_history_holds_what_other_callbacks_log_as_a_backup_can():
    """A callback may add a backend tensor, a NumPy value or text to the logs
    `History` keeps: saved as NumPy values (the write failed on a tensor),
    and anything else as `None`, with a warning naming it."""
    history = keras.callbacks.History()
    history.epoch = [0]
    history.history = {
        "loss": [0.5],
        "lr": [keras.ops.convert_to_tensor(0.25)],
        "f1": [np.array([0.5, 1.0], "float32")],
        "step": [np.int64(3)],
        "phase": ["warm-up"],
        "thing": [object()],
    }
    with pytest.warns(UserWarning, match="History logged 'thing' as a value of"):
        states = callback_state.capture([history])
    logged = states["History:0"]["history"]
    assert logged["loss"] == [0.5] and logged["phase"] == ["warm-up"]
    assert logged["lr"] == [0.25] and isinstance(logged["lr"][0], np.float32)
    assert logged["step"] == [3] and logged["thing"] == [None]
    np.testing.assert_array_equal(logged["f1"][0], [0.5, 1.0])
    tree, arrays = split(states)  # As a backup holds it.
    saved_state.check({"callbacks": join(tree, arrays)})
    fresh = keras.callbacks.History()
    callback_state.apply([fresh], states)
    assert fresh.epoch == [0] and fresh.history["lr"] == [0.25]


def test_protocol_callbacks_and_matching_by_class_and_position():
    first, second = Counter(), Counter()
    first.seen, second.seen = 3, 5
    states = callback_state.capture([first, keras.callbacks.Callback(), second])
    assert states == {"Counter:0": {"seen": 3}, "Counter:1": {"seen": 5}}
    restored = [Counter(), Counter()]
    callback_state.apply(restored, states)
    assert [c.seen for c in restored] == [3, 5]


def test_unknown_callbacks_are_ignored():
    class Plain(keras.callbacks.Callback):
        pass

    assert callback_state.capture([Plain(), keras.callbacks.TerminateOnNaN()]) == {}
    callback_state.apply([Plain()], {"Plain:0": {"x": 1}, "Gone:0": {}})


def test_a_get_state_that_returns_what_no_backup_holds_is_named():
    class Sets(Counter):
        def get_state(self):
            return {"seen": {self.seen}}

    with pytest.raises(
        TypeError, match=r"Sets:0's get_state\(\) holds a value of type set"
    ):
        callback_state.capture([Sets()])


def test_history_of_a_metric_with_a_value_per_class_resumes(tmp_path, data):
    """Keras logs `F1Score()`'s value per class as an array, which `History`
    keeps: a backup holding one restores (it was refused as damaged), and the
    resumed `History` equals the uninterrupted one's, arrays included."""
    import keras_ft

    x, y = data
    labels = keras.utils.to_categorical((y[:, 0] > y[:, 0].mean()).astype("int"))

    def fit(backup_dir, *crash):
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2, activation="softmax")]
        )
        model.compile("adam", "categorical_crossentropy",
                      metrics=[keras.metrics.F1Score()])  # fmt: skip
        backup = keras_ft.BackupAndRestore(str(backup_dir), save_freq=2)
        return model.fit(x, labels, batch_size=8, epochs=3, verbose=0,
                         callbacks=[backup, *crash]).history  # fmt: skip

    expected = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "resumed", CrashAt())
    history = fit(tmp_path / "resumed")
    assert sorted(history) == sorted(expected)
    for key, values in expected.items():
        assert len(history[key]) == len(values) == 3
        for found, value in zip(history[key], values, strict=True):
            assert type(found) is type(value)
            np.testing.assert_array_equal(found, value)
    assert isinstance(expected["f1_score"][0], np.ndarray)
