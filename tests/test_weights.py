"""Host-copy weights files are the ones Keras itself writes and loads."""

from __future__ import annotations

import h5py
import keras
import numpy as np
from conftest import make_model, weights_of

from keras_ft import weights


def layout(path):
    found = {}

    def visit(name, obj):
        attrs = {k: str(v) for k, v in obj.attrs.items()}
        if isinstance(obj, h5py.Dataset):
            found[name] = (
                "dataset",
                obj.shape,
                str(obj.dtype),
                attrs,
                obj[()].tobytes(),
            )
        else:
            found[name] = ("group", attrs)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def trained_model(data):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1, dtype="bfloat16"),
        ]
    )
    model.compile(keras.optimizers.Adam(), loss="mse")
    model.fit(*data, epochs=1, verbose=0)
    return model


def test_written_file_has_keras_own_layout(tmp_path, data):
    model = trained_model(data)
    model.save_weights(str(tmp_path / "keras.weights.h5"))
    weights.write(str(tmp_path / "ours.weights.h5"), weights.capture(model))
    assert layout(str(tmp_path / "ours.weights.h5")) == layout(
        str(tmp_path / "keras.weights.h5")
    )


def test_written_file_loads_with_load_weights(tmp_path, data):
    model = trained_model(data)
    captured = weights.capture(model)
    assert captured.nbytes > 0
    path = str(tmp_path / "ours.weights.h5")
    weights.write(path, captured)
    fresh = keras.models.clone_model(model)
    fresh.compile(keras.optimizers.Adam(), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_capture_is_a_copy_not_a_view(data):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    captured = weights.capture(model)
    before = [a.copy() for _, _, arrays in captured.groups for a in arrays.values()]
    model.fit(*data, epochs=1, verbose=0)  # Changes every variable.
    after = [a for _, _, arrays in captured.groups for a in arrays.values()]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
