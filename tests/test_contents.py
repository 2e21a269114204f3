"""What a checkpoint's own files must hold, checked without Keras
(`keras_ft/state/contents.py`). Forged backups read whole:
`test_hostile_backups.py`."""

from __future__ import annotations

import copy

import pytest
from conftest import run_once_on

from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import contents

ONCE = run_once_on("torch", "JSON checks; the backend does not matter")

METADATA = {
    "epochs_completed": 2,
    "batches_completed": 0,
    "step": 8,
    "saved_at": 1.8e9,
    "variables": [
        ["model", "dense/kernel", [4, 8], "float32"],
        ["optimizer", "adam/iterations", [], "int64"],
    ],  # fmt: skip
    "state_format": contents.STATE_FORMAT_VERSION,
    "state": {},
    "build_config": {"input_shape": [None, 4]},
}


@ONCE
def test_the_metadata_keras_ft_writes_passes():
    contents.check_metadata(copy.deepcopy(METADATA), "ckpt")
    without_optional = {
        k: v for k, v in METADATA.items() if k not in ("state", "build_config")
    }
    contents.check_metadata(without_optional, "ckpt")


@ONCE
@pytest.mark.parametrize(
    "change, bad",
    [
        (lambda m: m.update(step=-1), "step"),
        (lambda m: m.update(step=True), "step"),
        (lambda m: m.update(step=1 << 62), "step"),
        (lambda m: m.update(epochs_completed=2.0), "epochs_completed"),
        (lambda m: m.pop("batches_completed"), "batches_completed"),
        (lambda m: m.update(saved_at=float("nan")), "saved_at"),
        (lambda m: m.update(saved_at=2.6e11), "saved_at"),
        (lambda m: m.update(saved_at="today"), "saved_at"),
        (lambda m: m["variables"].append(["weights", "x", [1], "float32"]),
         "variables"),
        (lambda m: m["variables"].append(["model", "x", [-1], "float32"]),
         "variables"),
        (lambda m: m["variables"].append(["model", "x", [1]]), "variables"),
        (lambda m: m.update(variables={}), "variables"),
        (lambda m: m.update(state_format=2), "state_format"),
    ],
)  # fmt: skip
def test_metadata_not_keras_fts_is_damage_naming_what(change, bad):
    metadata = copy.deepcopy(METADATA)
    change(metadata)
    with pytest.raises(CorruptCheckpointError, match=f"bad {bad}"):
        contents.check_metadata(metadata, "ckpt")


@ONCE
@pytest.mark.parametrize(
    "metadata, said",
    [
        ([1, 2], "metadata is not an object"),
        ({**METADATA, "build_config": [4]}, "build_config is not an object"),
        ({**METADATA, "state": [1]}, "state is not an object"),
    ],
)
def test_metadata_of_the_wrong_kind_is_damage(metadata, said):
    with pytest.raises(CorruptCheckpointError, match=said):
        contents.check_metadata(metadata, "ckpt")


def nested(levels: int) -> list:
    tree: list = []
    for _ in range(levels - 1):
        tree = [tree]
    return tree


@ONCE
def test_depth_is_counted_without_recursion():
    assert contents.depth(3) == 0
    assert contents.depth({"a": [1, {"b": []}]}) == 4  # An empty list counts.
    assert contents.depth(nested(50)) == 50
    # Deeper than the interpreter's stack: counted up to the bound, no further.
    assert contents.depth(nested(200_000)) == contents.MAX_DEPTH + 1


@ONCE
def test_metadata_nested_too_deep_is_damage():
    metadata = {**copy.deepcopy(METADATA), "build_config": {"x": nested(150)}}
    with pytest.raises(CorruptCheckpointError, match="nested more than 100 levels"):
        contents.check_metadata(metadata, "ckpt")
