"""A backup's weights file loaded (`keras_ft/state/weights_load.py`): Keras'
own file read in place, a file of this layout without parsing, values read
ahead, a mismatch reported as Keras reports it. Written:
`test_weights_layout.py`."""

from __future__ import annotations

import os

import h5py
import keras
import numpy as np
import pytest
from conftest import iterations, make_model, weights_of
from test_weights_layout import trained_model, write

from keras_ft.state import weights_layout, weights_load


def test_load_reads_keras_own_file_in_place(tmp_path, data, monkeypatch):
    model = trained_model(data)
    path = str(tmp_path / "keras.weights.h5")
    model.save_weights(path)
    fresh = keras.models.clone_model(model)
    fresh.compile(keras.optimizers.Adam(), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    monkeypatch.setattr(fresh, "load_weights", None)  # Not the slow path.
    weights_load.load(fresh, path)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_falls_back_to_keras_for_compressed_datasets(tmp_path, data):
    model = trained_model(data)
    path = str(tmp_path / "compressed.weights.h5")
    write(path, weights_layout.capture(model))
    with h5py.File(path, "a") as f:
        kernel = f["layers/dense/vars/0"][()]
        del f["layers/dense/vars/0"]
        f["layers/dense/vars"].create_dataset("0", data=kernel, compression="gzip")
    fresh = keras.models.clone_model(model)
    fresh.compile(keras.optimizers.Adam(), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    weights_load.load(fresh, path)
    np.testing.assert_array_equal(weights_of(fresh)[0], weights_of(model)[0])


def test_load_reports_a_mismatch_as_keras_does(tmp_path, data):
    model = make_model(units=8)
    model.fit(*data, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    write(path, weights_layout.capture(model))
    other = make_model(units=16)
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="shape"):
        weights_load.load(other, path)


def saved_and_clone(tmp_path, data, build_optimizer=True):
    """A trained model, its weights file, and a clone with the same names."""
    model = trained_model(data)
    path = str(tmp_path / "w.weights.h5")
    write(path, weights_layout.capture(model))
    fresh = keras.models.clone_model(model)  # Same structure and names.
    fresh.compile(keras.optimizers.Adam(name=model.optimizer.name), loss="mse")
    if build_optimizer:
        fresh.optimizer.build(fresh.trainable_variables)
    return model, path, fresh


def test_a_file_written_for_the_same_layout_loads_without_parsing(
    tmp_path, data, monkeypatch
):
    model, path, fresh = saved_and_clone(tmp_path, data)
    layout = weights_layout.WeightsLayout(fresh)

    def no_parsing(*args):
        raise AssertionError("the file was parsed")

    monkeypatch.setattr(weights_load, "_contiguous_datasets", no_parsing)
    weights_load.load(fresh, path, layout)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == iterations(model)


def test_values_read_ahead_load_only_when_asked(tmp_path, data):
    model, path, fresh = saved_and_clone(tmp_path, data)
    before = [np.array(w) for w in weights_of(fresh)]
    layout = weights_layout.WeightsLayout(fresh)
    asked = []
    values = weights_load.read(fresh, path, layout, asked.append)
    assert values is not None
    # Read in file order, up to the end of the last value; nothing loaded.
    assert asked == sorted(asked) and asked[-1] <= os.path.getsize(path)
    for a, b in zip(before, weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    weights_load.load(fresh, path, layout, values)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == iterations(model)


@pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="staged restores are PyTorch's: JAX and TensorFlow have no public "
    "call to move a value from host memory they did not allocate without a "
    "staging copy of their own",
)
def test_a_staged_restore_moves_each_value_from_the_copy_buffer(tmp_path, data):
    """The path a model on a GPU takes (there the buffer is page-locked):
    the file is read into the layout's copy buffer, each value moved to the
    device from it, and the buffer is the next save's again, whole."""
    import torch

    model, path, fresh = saved_and_clone(tmp_path, data)
    layout = weights_layout.WeightsLayout(fresh)
    asked = []
    values = weights_load._read_staged(
        fresh, path, layout, torch.device("cpu"), asked.append
    )
    assert values is not None and values.mapped is None
    assert asked == [os.path.getsize(path)]  # The whole file, then read.
    weights_load.load(fresh, path, layout, values)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == iterations(model)
    # A file of this size with other bytes between the values (here, its
    # signature) is not this layout's; nor is a file of another size.
    with open(path, "rb") as f:
        contents = bytearray(f.read())
    contents[0] ^= 0xFF
    other = str(tmp_path / "other.weights.h5")
    for changed in (bytes(contents), bytes(contents[1:])):
        with open(other, "wb") as f:
            f.write(changed)
        cpu = torch.device("cpu")
        assert weights_load._read_staged(fresh, other, layout, cpu, None) is None
    # The buffer the files were read into makes the next save's file, whole:
    # the bytes between the values are the layout's own again.
    fresh.fit(*data, epochs=1, verbose=0)
    again = str(tmp_path / "again.weights.h5")
    write(again, layout.capture())
    reference = str(tmp_path / "reference.weights.h5")
    write(reference, weights_layout.capture(fresh))
    with open(again, "rb") as a, open(reference, "rb") as b:
        assert a.read() == b.read()


def test_values_read_for_other_variables_are_not_used(tmp_path, data):
    model, path, fresh = saved_and_clone(tmp_path, data, build_optimizer=False)
    # Read before the optimizer has variables: the file does not fit yet.
    assert weights_load.read(fresh, path, weights_layout.WeightsLayout(fresh)) is None
    fresh.optimizer.build(fresh.trainable_variables)
    layout = weights_layout.WeightsLayout(fresh)
    values = weights_load.read(fresh, path, layout)
    other = str(tmp_path / "other.weights.h5")
    write(other, weights_layout.capture(fresh))
    own = [np.array(w) for w in weights_of(fresh)]
    weights_load.load(fresh, other, layout, values)  # Values of another file.
    for a, b in zip(own, weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == 0 < iterations(model)


def test_a_file_of_another_layout_is_parsed_and_loads(tmp_path, data, monkeypatch):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    write(path, weights_layout.capture(model))
    fresh = make_model()  # New layer names: the bytes around the values differ.
    fresh.optimizer.build(fresh.trainable_variables)
    parsed = []
    original = weights_load._contiguous_datasets
    monkeypatch.setattr(
        weights_load,
        "_contiguous_datasets",
        lambda *a: parsed.append(1) or original(*a),
    )
    weights_load.load(fresh, path, weights_layout.WeightsLayout(fresh))
    assert parsed
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
