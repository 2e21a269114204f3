"""What a checkpoint's own files must hold, checked without Keras: its
metadata's shape, its arrays file, and its weights file's HDF5 structure.
A backup is untrusted input: a checkpoint whose checksums match but whose
contents are not keras-ft's is damaged (`keras-ft verify`, `watch()` and
the restore agree on that).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Any

import h5py

from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import arrays, hdf5, saved_state

STATE_FORMAT_VERSION = 1
# A checkpoint's weights file: the name `model.save_weights()` takes.
WEIGHTS_FILE = "model.weights.h5"


def inspect(metadata: Any, open_file: Callable[[str], IO[bytes]], where: str) -> None:
    """Checks a verified checkpoint's metadata and arrays file.

    Args:
        metadata: The checkpoint's metadata.
        open_file: Opens one of the checkpoint's files for reading.
        where: The checkpoint, for the error.

    Raises:
        CorruptCheckpointError: naming what is not keras-ft's.
    """
    check_metadata(metadata, where)
    with open_file(arrays.ARRAYS_FILE) as f:
        held = arrays.read(f, os.path.join(where, arrays.ARRAYS_FILE))
    try:
        saved_state.check(arrays.join(metadata.get("state", {}), held))
    except ValueError as e:
        raise CorruptCheckpointError(
            where, f"its saved state is malformed: {e}"
        ) from None
    try:
        weights = open_file(WEIGHTS_FILE)
    except FileNotFoundError:  # A sharded checkpoint: its shards hold the values.
        return
    with weights, h5py.File(weights, "r") as f:
        hdf5.check_plain(f, os.path.join(where, WEIGHTS_FILE))


# Bounds on what a metadata file may hold. Its deepest real nesting is a
# model's configuration (a few levels per model nested in a model); every
# reader of the tree (arrays.join(), configuration.differences()) recurses.
MAX_DEPTH = 100
_MAX_COUNT = 1 << 62  # Epochs, batches, steps, dimensions.
# Seconds since the epoch: up to the year 9999, which `datetime` can show.
_MAX_TIME = 253402300799.0


def check_metadata(metadata: Any, directory: str) -> None:
    """Raises `CorruptCheckpointError` unless `metadata` has the shape
    keras-ft writes (counters, variable list, state format)."""

    def is_count(value: Any) -> bool:
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and 0 <= value < _MAX_COUNT
        )

    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(directory, "its metadata is not an object")
    if depth(metadata) > MAX_DEPTH:
        raise CorruptCheckpointError(
            directory, f"its metadata is nested more than {MAX_DEPTH} levels deep"
        )
    build_config = metadata.get("build_config")
    if build_config is not None and not isinstance(build_config, dict):
        raise CorruptCheckpointError(directory, "its build_config is not an object")
    if not isinstance(metadata.get("state", {}), dict):
        raise CorruptCheckpointError(directory, "its state is not an object")
    problems = [
        key
        for key in ("epochs_completed", "batches_completed", "step")
        if not is_count(metadata.get(key))
    ]
    saved_at = metadata.get("saved_at")
    if (
        not isinstance(saved_at, (int, float))
        or isinstance(saved_at, bool)
        or not 0 <= saved_at <= _MAX_TIME  # NaN fails it too.
    ):
        problems.append("saved_at")
    variables = metadata.get("variables")
    if not isinstance(variables, list) or not all(
        isinstance(v, list)
        and len(v) == 4
        and v[0] in ("model", "optimizer")
        and isinstance(v[1], str)
        and isinstance(v[2], list)
        and all(is_count(d) for d in v[2])
        and isinstance(v[3], str)
        for v in variables
    ):
        problems.append("variables")
    if metadata.get("state_format") != STATE_FORMAT_VERSION:
        problems.append("state_format")
    if problems:
        raise CorruptCheckpointError(
            directory,
            f"its metadata is not keras-ft's (bad {', '.join(problems)}); written "
            "by another release, or edited by hand",
        )


def depth(tree: Any) -> int:
    """How deeply lists and objects nest in a JSON tree (a scalar: 0),
    without recursion: the tree is untrusted and may be deeper than the
    interpreter's stack."""
    deepest = 0
    pending = [(tree, 1)]
    while pending:
        node, level = pending.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:  # Deep enough to refuse: stop looking.
            return deepest
        pending.extend((child, level + 1) for child in children)
    return deepest
