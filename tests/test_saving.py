"""`keras_ft/compat/saving.py`: Keras' own walk of a model's saveables, run
with keras-ft's stores, against what `save_weights()` writes."""

from __future__ import annotations

import h5py
import keras
import numpy as np
import pytest
from conftest import BATCH_SIZE, make_model, weights_of

from keras_ft.compat import saving


def trained_model(data) -> keras.Model:
    model = make_model()
    model.fit(*data, epochs=1, batch_size=BATCH_SIZE, verbose=0)
    return model


def h5_groups(path: str) -> dict[str, dict[str, np.ndarray]]:
    """`{group path: {key: value}}` of a `.weights.h5` file's variables."""
    found: dict[str, dict[str, np.ndarray]] = {}

    def visit(name, item):
        if isinstance(item, h5py.Dataset) and name.endswith(item.name.split("/")[-1]):
            group, _, key = name.rpartition("/")
            if group.endswith("/vars"):
                found.setdefault(group[: -len("/vars")], {})[key] = item[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def test_the_recorded_groups_are_what_save_weights_writes(data, tmp_path):
    model = trained_model(data)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    written = h5_groups(path)
    recorded = {
        group: {key: keras.ops.convert_to_numpy(value) for key, value in values}
        for group, _, _, values in saving.record_saveables(model)
        if values
    }
    assert recorded.keys() == written.keys()
    for group, values in written.items():
        assert recorded[group].keys() == values.keys(), group
        for key, value in values.items():
            np.testing.assert_array_equal(recorded[group][key], value)
    # The optimizer's state is among them: its step and Adam's moments.
    assert any(g.startswith("optimizer") for g in recorded)


def test_groups_load_back_through_the_keras_walk_into_a_fresh_model(data):
    model = trained_model(data)
    groups = {
        group: {key: keras.ops.convert_to_numpy(value) for key, value in values}
        for group, _, _, values in saving.record_saveables(model)
    }
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    converted = []

    def convert(value):
        converted.append(value.shape)
        return value

    saving.load_with_keras_walk(fresh, groups, convert)
    assert len(converted) == sum(len(v) for v in groups.values())
    for mine, theirs in zip(weights_of(fresh), weights_of(model), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert int(fresh.optimizer.iterations) == int(model.optimizer.iterations)


def test_a_group_of_the_wrong_shape_raises_keras_own_loading_error(data):
    model = trained_model(data)
    groups = {
        group: {key: keras.ops.convert_to_numpy(value) for key, value in values}
        for group, _, _, values in saving.record_saveables(model)
    }
    dense = next(g for g in groups if g.endswith("dense"))
    groups[dense]["0"] = np.zeros((3, 3), "float32")
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    with pytest.raises(ValueError, match="dense"):
        saving.load_with_keras_walk(fresh, groups, lambda value: value)
