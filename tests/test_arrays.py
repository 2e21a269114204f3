"""JSON trees with NumPy arrays beside them in HDF5."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import arrays


def test_split_write_read_join_round_trip(tmp_path):
    tree = {
        "a": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "b": [1, 2.5, None, {"c": np.float32(1.5), "d": np.array([True, False])}],
        "e": (np.int64(7), "text"),
    }
    json_tree, found = arrays.split(tree)
    assert len(found) == 2
    path = str(tmp_path / "x.h5")
    with open(path, "wb") as f:
        f.write(arrays.to_bytes(found))
    back = arrays.join(json_tree, arrays.read(path))
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert back["a"].dtype == np.uint32
    assert back["b"][:3] == [1, 2.5, None]
    assert back["b"][3]["c"] == 1.5
    np.testing.assert_array_equal(back["b"][3]["d"], [True, False])
    assert back["e"] == [7, "text"]


def test_join_reports_a_missing_array():
    json_tree, _ = arrays.split({"a": np.zeros(2)})
    with pytest.raises(ValueError, match="missing"):
        arrays.join(json_tree, {})


def test_read_ignores_datasets_it_did_not_write(tmp_path):
    path = str(tmp_path / "x.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("a0", data=np.ones(2))
        f.create_dataset("../evil", data=np.ones(2))
        f.create_group("a1")
    assert list(arrays.read(path)) == ["a0"]


def test_read_refuses_datasets_that_are_not_numbers(tmp_path):
    path = str(tmp_path / "x.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("a0", data=np.array([b"text"], dtype=object),
                         dtype=h5py.string_dtype())  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="damaged: .*a0"):
        arrays.read(path)


def test_check_tree_takes_json_values_and_arrays():
    arrays.check_tree(
        {"a": [1, 2.5, True, None, "x", (np.int64(3), np.zeros(2))], "b": {}},
        "Mine.get_state()",
    )


@pytest.mark.parametrize(
    "tree, where",
    [
        ({"seen": {1, 2}}, r"a value of type set at \['seen'\]"),
        ([0, object()], r"a value of type object at \[1\]"),
        ({1: "a"}, "the key 1 at its top"),
        (b"bytes", "a value of type bytes at its top"),
    ],
    ids=["set", "object", "int key", "bytes"],
)
def test_check_tree_names_the_source_and_where(tree, where):
    with pytest.raises(TypeError, match=rf"Mine.get_state\(\) holds {where}: a backup"):
        arrays.check_tree(tree, "Mine.get_state()")
