"""FastForward: skipped steps consume data but never run the model."""

from __future__ import annotations

import keras
import numpy as np
from conftest import STEPS_PER_EPOCH, iterations, make_model, weights_of

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
