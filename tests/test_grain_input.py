"""`keras_ft/compat/grain_input.py`: a Grain dataset that `fit()` reads,
followed batch by batch, and started mid-epoch from an iterator's state.
Resumes through the callback: `test_inputs.py`."""

from __future__ import annotations

import keras
import pytest
from conftest import BATCH_SIZE, STEPS_PER_EPOCH, make_data, make_model

from keras_ft.compat import data as compat_data
from keras_ft.compat.grain_input import GrainView

grain = pytest.importorskip("grain")


def batches():
    x, y = make_data()
    return grain.MapDataset.source(list(zip(x, y, strict=True))).batch(BATCH_SIZE)


class Follows(keras.callbacks.Callback):
    """Puts a `GrainView` on the fit's input at train begin; with `start`,
    has the epoch start from an iterator's state after that many batches."""

    def __init__(self, start: tuple[dict, int] | None = None):
        super().__init__()
        self.start, self.seen, self.trained = start, [], 0

    def on_train_begin(self, logs=None):
        self.view = GrainView.of(compat_data.fit_epoch_iterator(), self.after_batch)
        if self.start is not None:
            self.view.skip(*self.start, placeholders=False)

    def on_train_batch_end(self, batch, logs=None):
        self.trained += 1

    def after_batch(self, position, state):
        self.seen.append((position, state))

    def on_train_end(self, logs=None):
        self.view.remove()


def fit(follows: Follows) -> keras.Model:
    model = make_model()
    model.fit(batches(), epochs=1, callbacks=[follows], verbose=0, shuffle=False)
    return model


def test_each_batch_handed_on_comes_with_the_state_after_it():
    follows = Follows()
    fit(follows)
    assert follows.view is not None
    positions = [position for position, _ in follows.seen]
    assert positions == list(range(1, STEPS_PER_EPOCH + 1))
    # A MapDataset's state is the index of its next element.
    for position, state in follows.seen:
        assert isinstance(state, dict) and position in state.values()


def test_an_epoch_started_from_a_state_trains_only_what_is_after_it():
    first = Follows()
    fit(first)
    position, state = first.seen[1]  # After the epoch's second batch.
    resumed = Follows((state, position))
    fit(resumed)
    assert [p for p, _ in resumed.seen] == list(range(3, STEPS_PER_EPOCH + 1))
    # Batch ends, not `iterations`: TensorFlow's fit() counts one step more
    # at the end of an input of unknown length.
    assert first.trained == STEPS_PER_EPOCH
    assert resumed.trained == STEPS_PER_EPOCH - 2


def test_other_inputs_get_no_view(data):
    class Other(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            iterator = compat_data.fit_epoch_iterator()
            self.view = GrainView.of(iterator, lambda position, state: None)

    other = Other()
    make_model().fit(*data, batch_size=BATCH_SIZE, callbacks=[other], verbose=0)
    assert other.view is None
