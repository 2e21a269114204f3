"""`keras_ft/compat/training.py`: what keras-ft reads and sets of a running
`fit()` and of the stock callbacks, checked against this Keras."""

from __future__ import annotations

import functools
import os

import keras
import numpy as np
from conftest import BATCH_SIZE, STEPS_PER_EPOCH, make_model, weights_of

from keras_ft.compat import training


class Probe(keras.callbacks.Callback):
    """Records what the compat functions see from inside a real fit()."""

    def __init__(self, start_at: int | None = None):
        super().__init__()
        self.start_at, self.epochs = start_at, []
        self.callback_list = None

    def on_train_begin(self, logs=None):
        self.callback_list = training.calling_callback_list(self)
        if self.start_at is not None:
            self.honoured = training.set_initial_epoch(self.model, self.start_at)

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def test_code_names_sees_through_a_wrapper():
    def reads(obj):
        return obj.some_attribute + len(obj)

    @functools.wraps(reads)
    def wrapper(*args):
        return reads(*args)

    assert {"some_attribute", "len"} <= training.code_names(wrapper)
    assert training.code_names(len) == set()  # Built in: no code object.


def test_local_up_the_stack_finds_the_nearest_accepted_local_within_depth():
    def outer():
        marker = "outer"  # noqa: F841  (read from the frame)
        return middle()

    def middle():
        marker = 3  # noqa: F841
        return inner()

    def inner():
        frame = training.current_frame()
        return (
            training.local_up_the_stack(
                frame, 3, "marker", lambda v: isinstance(v, str)
            ),
            training.local_up_the_stack(
                frame, 2, "marker", lambda v: isinstance(v, str)
            ),
            training.local_up_the_stack(frame, 3, "marker", lambda v: v == 3),
        )

    assert outer() == ("outer", None, 3)


def test_the_callback_list_and_the_initial_epoch_of_a_running_fit(data):
    probe = Probe(start_at=2)
    other = keras.callbacks.History()
    make_model().fit(*data, epochs=4, batch_size=BATCH_SIZE, callbacks=[other, probe],
                     verbose=0)  # fmt: skip
    assert probe.callback_list is not None
    assert any(c is other for c in probe.callback_list.callbacks)
    assert probe.honoured and probe.epochs == [2, 3]
    # Called by hand, outside fit(): no list.
    assert training.calling_callback_list(probe) is None


def test_tensorboard_counts_batches_from_the_count_it_is_given(data, tmp_path):
    board = keras.callbacks.TensorBoard(str(tmp_path / "logs"), update_freq="batch")
    make_model().fit(*data, epochs=1, batch_size=BATCH_SIZE, callbacks=[board],
                     verbose=0)  # fmt: skip
    assert training.tensorboard_batches(board) == STEPS_PER_EPOCH
    training.set_tensorboard_batches(board, 100)
    assert training.tensorboard_batches(board) == 100
    train, validation = training.tensorboard_dirs(board)
    assert train == os.path.join(str(tmp_path / "logs"), "train")
    assert validation == os.path.join(str(tmp_path / "logs"), "validation")


def test_a_counted_batch_moves_model_checkpoint_toward_its_next_save(data, tmp_path):
    path = str(tmp_path / "every_3.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, save_weights_only=True, save_freq=3
    )
    checkpoint.set_model(make_model())
    checkpoint.on_epoch_begin(0)
    # Two batch ends counted as its own would count them: the next one saves.
    training.count_checkpoint_batch(checkpoint, 0)
    training.count_checkpoint_batch(checkpoint, 1)
    assert not os.path.exists(path)
    checkpoint.on_train_batch_end(2, {"loss": 1.0})
    assert os.path.exists(path)
    assert training.private_counters("ModelCheckpoint") == (
        "_batches_seen_since_last_saving",
        "_last_batch_seen",
    )
    assert training.private_counters("EarlyStopping") == ()


def test_swapped_in_ema_weights_are_found_and_swapped_back(data):
    model = make_model()
    model.compile(keras.optimizers.Adam(1e-2, use_ema=True), loss="mse")
    swap = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
    # Steps outside fit(), which would end with the averages as the weights.
    for _ in range(3):
        model.train_on_batch(data[0][:BATCH_SIZE], data[1][:BATCH_SIZE])
    swap.set_model(model)
    trained = weights_of(model)
    assert training.swapped_in([swap]) == []
    swap.on_test_begin()  # Swaps the moving averages in, as evaluate() would.
    assert training.swapped_in([swap]) == [swap]
    averaged = weights_of(model)
    assert any(not np.array_equal(a, b) for a, b in zip(trained, averaged, strict=True))
    training.swap_ema(swap)  # Its own inverse: the trained weights are back
    for a, b in zip(trained, weights_of(model), strict=True):  # (TensorFlow's
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # by sums).
