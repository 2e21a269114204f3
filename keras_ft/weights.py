"""Keras' `.weights.h5`, written from host copies of the variables.

`model.save_weights()` reads the variables while it writes, so it must run in
the training thread for the whole write. Here the two halves are split:
`capture()` walks the model exactly as `save_weights()` does (Keras' own
traversal, so every layer and optimizer is covered) and copies each variable
to host memory, which is fast; `write()` lays the copies out in the same HDF5
structure, which `model.load_weights()` reads, and can run in another thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import h5py
import keras
import numpy as np
from keras.src.saving import saving_lib


@dataclasses.dataclass
class CapturedWeights:
    """Host copies of a model's variables, grouped as in a `.weights.h5`."""

    # (group path, group attributes, {dataset name: array}), in save order.
    groups: list[tuple[str, dict | None, dict[str, np.ndarray]]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, _, arrays in self.groups for a in arrays.values())


class _Recorder(saving_lib.H5IOStore):
    """Stands where `save_weights()` puts its HDF5 store, and keeps copies.

    `_save_state` accepts only Keras' own store classes, hence the subclass;
    none of its file handling is used.
    """

    def __init__(self) -> None:  # noqa: D107 - no HDF5 file behind it.
        self.groups: list[tuple[str, dict | None, dict[str, np.ndarray]]] = []

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict | None = None) -> _Recorder:
        self.groups.append((path, dict(metadata) if metadata else None, {}))
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        # A copy: the backend may reuse the buffer in the next training step.
        self.groups[-1][2][key] = np.array(keras.ops.convert_to_numpy(value))

    def close(self) -> None:
        pass


def capture(model: keras.Model) -> CapturedWeights:
    """Copies every variable `model.save_weights()` would save to host memory."""
    recorder = _Recorder()
    saving_lib._save_state(
        model,
        weights_store=recorder,
        assets_store=None,
        inner_path="",
        visited_saveables=set(),
    )
    return CapturedWeights(recorder.groups)


def write(path: str, weights: CapturedWeights) -> None:
    """Writes `weights` as the `.weights.h5` file `save_weights()` would."""
    with h5py.File(path, "w") as f:
        for group_path, metadata, arrays in weights.groups:
            if not arrays and not metadata:
                continue  # Keras creates no group for a store left unused.
            parent = f.require_group(group_path) if group_path else f
            group = parent.create_group("vars")
            for key, value in (metadata or {}).items():
                group.attrs[key] = value
            for key, array in arrays.items():
                if keras.backend.standardize_dtype(array.dtype) == "bfloat16":
                    group.create_dataset(key, data=array).attrs["dtype"] = "bfloat16"
                else:
                    group[key] = array
