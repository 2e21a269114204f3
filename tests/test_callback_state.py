"""Other callbacks' state: stock callbacks, the protocol, and the rest."""

from __future__ import annotations

import keras
import numpy as np
import pytest

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
