"""Loading a weights file into a model, the way `model.load_weights()` does.

The file is mapped, not read: each value goes from the page cache to the
backend in one copy. A file the model's own `WeightsLayout` wrote needs
neither parsing nor a walk of the model; other files whose datasets are all
stored contiguously (the ones Keras writes) are parsed for where the values
lie and loaded through Keras' own walk; any other file goes through
`model.load_weights()`.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import h5py
import keras
import ml_dtypes
import numpy as np

from keras_ft import compat
from keras_ft.backend import device_memory, host_memory
from keras_ft.checkpoint import files as file_io
from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import hdf5
from keras_ft.state.weights_copy import Slot, slot_view
from keras_ft.state.weights_layout import (
    EXACT_GROUP,
    WEIGHTS_FILE,
    WeightsLayout,
    fingerprint,
    load_exact,
    load_exact_store,
)

try:
    import fcntl
except ImportError:  # Not POSIX: lock.check_platform() stops a backup first.
    fcntl = None

# Element types a weights file may hold; anything else is not ours to read.
_NUMERIC_KINDS = "biuf"


@dataclasses.dataclass
class ReadWeights:
    """A weights file's values, read ahead of loading them (see `read()`)."""

    path: str
    fingerprint: tuple
    stores: list[tuple[Any, dict]]
    mapped: Any = dataclasses.field(repr=False)


def read(
    model: keras.Model,
    path: str,
    layout: WeightsLayout,
    ready: Callable[[int], None] | None = None,
) -> ReadWeights | None:
    """Reads a file `layout` wrote into values ready for `load()`.

    The model is not touched, so this can run while the file is still being
    verified, and its result be dropped if verification fails. `ready`
    is as in `WeightsLayout.values_in()`.

    Returns:
        The values, or `None` for a file `layout` did not write (or that is
        missing or empty), which `load()` then reads the slow way.
    """
    if layout.model is not model:
        return None
    device = layout.staging_device()
    if device is not None:
        return _read_staged(model, path, layout, device, ready)
    try:
        mapped = _map(path)
    except (OSError, ValueError):  # `check()` then names what is wrong.
        return None
    if mapped is None:
        return None
    stores = layout.values_in(mapped, ready)
    if stores is None:
        return None
    return ReadWeights(path, fingerprint(model), stores, mapped)


def _read_staged(
    model: keras.Model,
    path: str,
    layout: WeightsLayout,
    device: Any,
    ready: Callable[[int], None] | None,
) -> ReadWeights | None:
    """`read()` for a model on an accelerator that takes page-locked host
    memory: the file is read into the layout's page-locked copy buffer and
    each value moved to the device in one transfer from there, rather than
    staged by the driver through pageable memory."""
    fd = file_io.open_regular(path, depth=file_io.CHECKPOINT_FILE)
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if not size or size != layout.size:
            return None  # Not this layout's file: `load()` reads it otherwise.
        if ready is not None:
            ready(size)

        def read_file(image: memoryview) -> None:
            done = 0
            while done < size:
                got = f.readinto(image[done:size])
                if not got:
                    raise CorruptCheckpointError(f"{path} ended while being read")
                done += got

        with layout.staged(read_file, device) as image:
            stores = layout.values_in(image, device=device)
            # The buffer is the next save's: every move out of it first.
            device_memory.transfers_done(device)
    if stores is None:
        return None
    return ReadWeights(path, fingerprint(model), stores, None)


def _map(path: str) -> mmap.mmap | None:
    """`path` mapped copy-on-write and share-locked, or `None` if empty."""
    fd = file_io.open_regular(path, depth=file_io.CHECKPOINT_FILE)
    with os.fdopen(fd, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return None
        # Copy-on-write: a loader that changes a value in place changes only
        # its own pages, never the checkpoint.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        # A backend may keep using the mapped values (JAX can alias host
        # memory): a shared lock for as long as the mapping lives keeps the
        # store from overwriting the file when it recycles the checkpoint.
        held = os.dup(f.fileno())
        fcntl.flock(held, fcntl.LOCK_SH)
        weakref.finalize(mapped, os.close, held)
    return mapped


def load(
    model: keras.Model,
    path: str,
    layout: WeightsLayout | None = None,
    values: ReadWeights | None = None,
) -> None:
    """Loads a `.weights.h5` file into `model`, like `model.load_weights()`.

    The file is mapped, not read: each value goes from the page cache to the
    backend in one copy. A file that `layout` wrote (its bytes outside the
    values equal the layout's own) is loaded through the layout's objects,
    without parsing it or walking the model; other files whose datasets are
    all stored contiguously (the ones Keras writes) are parsed for where the
    values lie and loaded through Keras' own walk; any other file goes
    through `model.load_weights()`.

    Args:
        model: The model to load into.
        path: The weights file.
        layout: The model's `WeightsLayout`, if it has one. Defaults to `None`.
        values: The file's values from `read()`, used if they are of
            `path` and the model still has the variables they were read
            for. Defaults to `None`.
    """
    if (
        values is not None
        and values.path == path
        and values.fingerprint == fingerprint(model)
    ):
        load_stores(values.stores)
        return
    mapped = _map(path) if compat.usable("fast_weights") else None
    if mapped is None:
        load_with_keras(model, path)
        return
    if layout is not None and layout.model is model and load_stores_of(layout, mapped):
        return
    size = len(mapped)
    groups = _contiguous_datasets(path, size)
    if groups is None:
        load_with_keras(model, path)
        return
    buffer = np.frombuffer(mapped, np.uint8)
    views = {
        group: {slot.key: slot_view(buffer, slot) for slot in slots}
        for group, slots in groups.items()
    }
    compat.load_with_keras_walk(model, views, host_memory.for_assign)
    exact = views.get(EXACT_GROUP)
    if exact:
        load_exact_store(
            model, {k: host_memory.for_assign(v) for k, v in exact.items()}
        )


def check(path: str, layout: WeightsLayout | None = None) -> None:
    """Checks a backup's weights file before anything of it is loaded.

    The file must be plain HDF5 (`hdf5.check_plain()`: no links to other
    files, nothing compressed or declared larger than stored), and, where
    `layout` knows what the model's own save writes, each of its datasets
    must have that dtype: a value is loaded as saved, never cast.

    Raises:
        CorruptCheckpointError: naming the file and what is wrong.
    """
    directory, name = os.path.split(path)
    expected = layout.dataset_dtypes() if layout is not None else {}
    try:
        with (
            file_io.pinned(path, file_io.CHECKPOINT_FILE) as pinned,
            h5py.File(pinned, "r") as f,
        ):
            hdf5.check_plain(f, path)
            found: list[tuple[str, np.dtype]] = []

            def visit(dataset_name: str, item: Any) -> None:
                if isinstance(item, h5py.Dataset) and dataset_name in expected:
                    found.append((dataset_name, _dtype_of(item)))

            f.visititems(visit)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            directory, f"{name} cannot be read as HDF5 ({e})"
        ) from None
    for dataset_name, dtype in found:
        if dtype != expected[dataset_name]:
            raise CorruptCheckpointError(
                directory,
                f"{name}: {dataset_name} is {dtype}, but the model saves it as "
                f"{expected[dataset_name]} (values are loaded as saved, never cast)",
            )


def _dtype_of(dataset: h5py.Dataset) -> np.dtype:
    if dataset.attrs.get("dtype") == "bfloat16" and dataset.dtype.itemsize == 2:
        return np.dtype(ml_dtypes.bfloat16)
    return dataset.dtype


def load_with_keras(model: keras.Model, path: str) -> None:
    """`model.load_weights()`, then the variables' own values on top."""
    with file_io.pinned(path, file_io.CHECKPOINT_FILE, WEIGHTS_FILE) as pinned:
        model.load_weights(pinned)
        load_exact(model, pinned)


def load_stores(stores: list[tuple[Any, dict]]) -> None:
    """Hands each object its values, through its own `load_own_variables()`."""
    errors: dict[int, tuple[Any, Exception]] = {}
    for saveable, store in stores:
        try:
            saveable.load_own_variables(store)
        except Exception as e:  # Reported all together, as Keras does.
            errors[id(saveable)] = (saveable, e)
    if errors:
        compat.raise_loading_failure(errors)


def _contiguous_datasets(path: str, size: int) -> dict[str, list[Slot]] | None:
    """Each group's datasets with their offsets, or `None` if any is not
    stored contiguously inside the file (chunked, compressed, external, a
    link, an unknown type), for `model.load_weights()` to deal with."""
    groups: dict[str, list[Slot]] = {}
    plain = True

    def visit(name: str, link: Any) -> None:
        nonlocal plain
        if not isinstance(link, h5py.HardLink):
            plain = False
            return
        if f[name].__class__ is not h5py.Dataset:
            return
        dataset = f[name]
        parent, _, key = name.rpartition("/")
        if parent != "vars" and not parent.endswith("/vars"):
            plain = False
            return
        group = parent[: -len("vars")].rstrip("/")
        dtype = _dtype_of(dataset)
        if dtype != ml_dtypes.bfloat16 and dtype.kind not in _NUMERIC_KINDS:
            plain = False
            return
        slot = Slot(key, tuple(dataset.shape), dtype, dataset.id.get_offset())
        stored = dataset.id.get_storage_size()
        if (
            dataset.chunks is not None
            or dataset.external
            or dataset.is_virtual
            or (slot.nbytes and (slot.offset is None or stored != slot.nbytes))
            or (slot.offset is not None and slot.offset + slot.nbytes > size)
        ):
            plain = False
            return
        if slot.offset is None:
            slot = dataclasses.replace(slot, offset=0)
        groups.setdefault(group, []).append(slot)

    try:
        with (
            file_io.pinned(path, file_io.CHECKPOINT_FILE) as pinned,
            h5py.File(pinned, "r") as f,
        ):
            f.visititems_links(visit)
    except (OSError, ValueError):
        return None
    return groups if plain else None


def load_stores_of(layout: WeightsLayout, contents: Any) -> bool:
    """Loads a weights file's bytes into the model, if `layout` wrote it.

    Returns:
        `False`, having loaded nothing, for a file laid out otherwise
        (for another model structure, by Keras, or with other names).
    """
    stores = layout.values_in(contents)
    if stores is None:
        return False
    load_stores(stores)
    return True
