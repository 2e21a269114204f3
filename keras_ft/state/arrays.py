"""JSON metadata with NumPy arrays beside it, in one HDF5 file.

State that is not a Keras variable (random generator states, other callbacks'
best weights) is a tree of JSON values and NumPy arrays. `split` replaces each
array by a reference, so the tree goes into JSON and the arrays into HDF5;
`join` puts them back. Reading never unpickles: HDF5 datasets and JSON only.
"""

from __future__ import annotations

import io
import os
import re
from typing import IO, Any

import h5py
import numpy as np

from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import hdf5

ARRAYS_FILE = "arrays.h5"
_REF = "__keras_ft_array__"
_NAME = re.compile(r"a[0-9]{1,9}", re.ASCII)


def check_tree(tree: Any, source: str) -> None:
    """Raises `TypeError`, naming `source` (what returned it) and where in
    it, unless `tree` is JSON values and NumPy arrays: what `split` can save.
    Asked before a save holds the tree, rather than failing in its write."""

    def visit(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"{source} holds the key {key!r} at {where or 'its top'}: "
                        f"{_PLAIN}"
                    )
                visit(value, f"{where}[{key!r}]")
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                visit(value, f"{where}[{i}]")
        elif node is not None and not isinstance(node, _LEAVES):
            kind = type(node).__name__
            raise TypeError(
                f"{source} holds a value of type {kind} at {where or 'its top'}: "
                f"{_PLAIN}"
            )

    visit(tree, "")


_LEAVES = (str, int, float, bool, np.ndarray, np.generic)
_PLAIN = (
    "a backup holds JSON values (dicts with string keys, lists, strings, "
    "numbers, booleans, None) and NumPy arrays. Return only those."
)


def split(tree: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Returns `tree` with arrays replaced by references, and the arrays."""
    arrays: dict[str, np.ndarray] = {}

    def visit(node: Any) -> Any:
        if isinstance(node, np.ndarray):
            name = f"a{len(arrays)}"
            arrays[name] = node
            return {_REF: name}
        if isinstance(node, np.generic):
            return node.item()
        if isinstance(node, dict):
            return {str(k): visit(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [visit(v) for v in node]
        return node

    return visit(tree), arrays


def join(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Inverse of `split`."""
    if isinstance(tree, dict):
        if set(tree) == {_REF}:
            name = tree[_REF]
            if name not in arrays:
                raise ValueError(f"array {name!r} is missing from {ARRAYS_FILE}")
            return arrays[name]
        return {k: join(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join(v, arrays) for v in tree]
    return tree


def to_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """The HDF5 file that `read()` reads back, as bytes to be written."""
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        for name, array in arrays.items():
            f.create_dataset(name, data=array)
    return image.getvalue()


def read(source: str | IO[bytes], path: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of a file `to_bytes()` made; other names are ignored.

    Args:
        source: The file's path, or the file open for reading.
        path: Where the file is, for errors. Defaults to `source`.

    Raises:
        keras_ft.CorruptCheckpointError: for a file `to_bytes()` did not
            make: a dataset that is not plain numbers or booleans, or one that
            is not stored whole inside the file (`hdf5.check_plain()`).
    """
    path = path or os.fspath(source)
    arrays = {}
    with h5py.File(source, "r") as f:
        hdf5.check_plain(f, path)
        for name in f:
            dataset = f[name]
            if not _NAME.fullmatch(name) or not isinstance(dataset, h5py.Dataset):
                continue
            if dataset.dtype.kind not in hdf5.NUMERIC_KINDS:
                raise CorruptCheckpointError(
                    os.path.dirname(path),
                    f"{ARRAYS_FILE}: dataset {name!r} holds {dataset.dtype}, "
                    "not numbers",
                )
            arrays[name] = dataset[()]
    return arrays
