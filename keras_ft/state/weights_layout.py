"""Keras' `.weights.h5`, captured from the variables and written at disk speed.

`model.save_weights()` finds what to save by walking every attribute of the
model, layers and optimizer, copies every variable (twice, for optimizers),
and writes through h5py while holding the GIL, all in the training thread.
Here the walk runs once per model structure, and its result is kept as a
`WeightsLayout`: which object writes each HDF5 group, and at which byte
offset of the file each value lies, the file's HDF5 structure being laid out
once with every dataset stored contiguously. A save is then one copy of each
variable into its place in a file image (`copy=True`, for a write in another
thread, which can follow the copy piece by piece) or no copy at all
(`copy=False`), and plain writes of the file's bytes: no walk, no h5py, no
GIL. The file is the one `save_weights()` writes (same groups,
attributes, datasets and values) and `model.load_weights()` reads it.

Keras' walk is made for inference files: a LoRA layer stores its kernel
with the factors merged in (and zeroes the factors when it loads), a
quantized layer with LoRA re-quantizes that merge. A backup must resume the
training that was running, so the variables the walk does not store as
they are get one more group, `keras_ft_exact`, holding their own values;
`load_weights()` never reads it (Keras walks the model, not the file), and
a restore applies it after Keras' own groups.
`load()` maps a file and hands each object views of its values, through its
own `load_own_variables()`; a file the layout itself wrote (recognised by its
bytes outside the values) needs neither parsing nor another walk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import h5py
import keras
import ml_dtypes
import numpy as np

from keras_ft import compat, threads
from keras_ft.backend import device_memory, finiteness, host_memory
from keras_ft.checkpoint import files as file_io
from keras_ft.state import hdf5
from keras_ft.state.contents import WEIGHTS_FILE
from keras_ft.state.weights_copy import (
    CapturedWeights,
    CopyBuffer,
    Slot,
    slot_view,
)

try:
    import fcntl
except ImportError:  # Not POSIX: lock.check_platform() stops a backup first.
    fcntl = None

# Keras' optimizers store a copy of each variable (`variable.numpy()`).
_KERAS_OPTIMIZER_SAVE = keras.optimizers.Optimizer.save_own_variables
# Big datasets start on a page boundary: aligned copies, aligned views.
_ALIGN_THRESHOLD = 64 * 1024
_ALIGN = 4096
# Element types a weights file may hold; anything else is not ours to read.
_NUMERIC_KINDS = "biuf"
# The group holding the own values of the variables Keras' walk changes.
EXACT_GROUP = "keras_ft_exact"


@dataclasses.dataclass
class _Group:
    """One object's `save_own_variables()`: an HDF5 group `<path>/vars`."""

    path: str
    metadata: dict | None
    saveable: Any
    slots: list[Slot]


class WeightsLayout:
    """What `save_weights()` writes for one model structure, and where.

    Built by one walk of the model (Keras' own traversal, so every layer and
    optimizer is covered); `capture()` reuses it as long as the model has the
    same variables, and walks again when they change.

    Args:
        model: The `keras.Model` whose weights to capture.
        pools: The helper threads of its copies. Defaults to `None`: its
            own.
    """

    def __init__(self, model: keras.Model, pools: threads.Pools | None = None):
        self.model = model
        self._pools = pools or threads.Pools()
        self._fingerprint: tuple | None = None
        self._fast = False  # Laid out by Keras' own walk (not the fallback).
        self._groups: list[_Group] = []
        self._size = 0
        # The file's bytes outside the datasets: (offset, bytes), in order.
        self._gaps: list[tuple[int, bytes]] = []
        self._buffer: CopyBuffer | None = None  # Of this layout, made once.

    def capture(
        self,
        copy: bool = True,
        fill: bool = True,
        check_later: bool = False,
        on_device: bool = False,
    ) -> CapturedWeights:
        """The model's weights file as it would be written now.

        Args:
            copy: If `True`, the values are copied into a buffer this layout
                owns, so training may go on while it is written. The next
                `capture(copy=True)` reuses that buffer, so write this one
                first. If `False`, the chunks are views of the variables,
                valid until the next training step. Defaults to `True`.
            fill: With `copy`, whether to copy now. If `False`, the caller
                calls `fill()` before the variables change, and may hand the
                capture to a writer first, which then follows the copy; the
                writer must `release()` it once written, since the next
                capture's copy waits for that. Defaults to `True`.
            check_later: With `copy`, whether the NaN/infinity check runs
                after the copy, in the background, rather than during it:
                `filled` then waits for the check, and `non_finite` is known
                once `filled` finishes (not where the copy waits for the
                last write: see `CopyBuffer.capture()`). Defaults to `False`.
            on_device: With `copy` and not `fill`, whether the values are
                first copied on the device they live on (see
                `backend.device_snapshot()`), and `fill()` then moves that
                copy to the buffer: it may run in any thread while training
                goes on, and the NaN/infinity check follows it there.
                Without both, ignored. Defaults to `False`: `fill()` reads
                the variables themselves.
        """
        self._ensure_laid_out()
        on_device = on_device and copy and not fill  # Else: read in place.
        read = functools.partial(self._read_values, raw=on_device)
        values = read() if self._fast else None
        if self._fast and values is None:  # Other keys or shapes than planned.
            self._lay_out()
            values = read() if self._fast else None
        if not self._fast:
            return _capture_public(self.model)
        if values is None:
            raise RuntimeError(
                f"The `save_own_variables()` of a layer or optimizer of model "
                f"{self.model.name!r} stores different variables each time it is "
                "called, so its weights have no fixed layout. keras-ft needs the "
                "same keys, shapes and dtypes from one call to the next."
            )
        if not copy:
            return CapturedWeights(self._chunks_around(values))
        if on_device:
            copies, made = device_memory.device_snapshot(values)

            def move(
                destinations: list[np.ndarray],
                stopped: Callable[[], bool],
                order: list[int],
                landed: Callable[[int], None],
            ) -> bool:
                made()
                # In the buffer's file order; each copy let go once moved.
                ordered = [copies[i] for i in order]
                copies.clear()
                return device_memory.move_to_host(
                    ordered, destinations, stopped, landed
                )

            buffer = self._copy_buffer()
            if values:  # Not waited for: training goes on.
                buffer.pin(device_memory.staging_device(values[0]), wait=False)
            captured = buffer.capture([], fill, move=move)
            captured.from_device = True
            return captured
        return self._copy_buffer().capture(values, fill, check_later)

    def dataset_names(self) -> list[str]:
        """HDF5 paths of the datasets with bytes, in `_data_slots()` order."""
        return [
            f"{group.path}/vars/{slot.key}".lstrip("/")
            for group in self._groups
            for slot in group.slots
            if slot.offset is not None
        ]

    def dataset_dtypes(self) -> dict[str, np.dtype]:
        """`{HDF5 path: dtype}` of every dataset the model's own save writes,
        or `{}` where Keras' walk is unavailable (the file is then Keras')."""
        self._ensure_laid_out()
        return {
            f"{group.path}/vars/{slot.key}".lstrip("/"): slot.dtype
            for group in self._groups
            for slot in group.slots
        }

    def prepare(self, copy: bool = True) -> None:
        """Walks the model now rather than at the first capture; with `copy`,
        starts allocating the copy buffer in the background (see
        `CopyBuffer.prepare()`)."""
        self._ensure_laid_out()
        if copy and self._fast:
            self._copy_buffer().prepare()

    def reuse(self, buffer: CopyBuffer | None) -> None:
        """Takes `buffer` (the copy buffer of an earlier layout of this
        model: the last fit()'s, its writes over) as this layout's own where
        it holds the same file, rather than allocating (and page-locking)
        another."""
        self._ensure_laid_out()
        if buffer is None or not self._fast or self._buffer is not None:
            return
        if buffer.holds(
            self._size, self._gaps, self._data_slots(), self.dataset_names()
        ):
            buffer.forget_writes()
            self._buffer = buffer

    @property
    def copy_buffer(self) -> CopyBuffer | None:
        """The buffer copies go into, if one was made."""
        return self._buffer

    def release(self) -> None:
        """Frees the copy buffer; the next `capture(copy=True)` makes a new one.

        A write still using it keeps it alive until it is done.
        """
        if self._buffer is not None:
            self._buffer.release()
        self._buffer = None

    def _copy_buffer(self) -> CopyBuffer:
        if self._buffer is None:
            self._buffer = CopyBuffer(
                self._size,
                self._gaps,
                self._data_slots(),
                self.dataset_names(),
                self._pools,
            )
        return self._buffer

    @property
    def size(self) -> int:
        """The weights file's size in bytes, as laid out (0 when the file is
        Keras' own)."""
        self._ensure_laid_out()
        return self._size

    def staging_device(self) -> Any:
        """The accelerator a restore moves this model's values to from
        page-locked memory (`backend.staging_device()`), or `None`."""
        self._ensure_laid_out()
        values = self._read_values(raw=True) if self._fast else None
        return device_memory.staging_device(values[0]) if values else None

    @contextlib.contextmanager
    def staged(
        self, read: Callable[[memoryview], None], device: Any
    ) -> Iterator[memoryview]:
        """The copy buffer, page-locked for `device`, holding what `read()`
        put there (see `CopyBuffer.staged()`)."""
        buffer = self._copy_buffer()
        buffer.pin(device)
        with buffer.staged(read) as image:
            yield image

    def values_in(
        self,
        contents: Any,
        ready: Callable[[int], None] | None = None,
        device: Any = None,
    ) -> list[tuple[Any, dict]] | None:
        """A weights file's values, for each object's `load_own_variables()`.

        The bytes are not parsed: those outside the values must equal the
        layout's own, which pins each value's place, shape and type. The
        values are in the form the backend's `assign()` takes (on
        TensorFlow, tensors holding a copy); the model is not touched.

        Args:
            contents: The file's bytes.
            ready: Called with an offset, returns once the bytes before it
                are in memory. The file is read in order of offsets.
            device: Where `contents` is page-locked memory, the device
                (`staging_device()`) each value is moved to, without
                waiting (`backend.transfers_done()` waits).

        Returns:
            `(object, store)` pairs, or `None` for a file laid out otherwise.
        """
        self._ensure_laid_out()
        if len(contents) != self._size or not self._size:
            return None  # Also when the fast path is unavailable: no layout.
        buffer = np.frombuffer(contents, np.uint8)
        parts: list[tuple[int, bytes | Slot]] = [*self._gaps]
        parts += [(s.offset, s) for s in self._data_slots()]
        values: dict[Slot, Any] = {}

        def for_assign(array: np.ndarray) -> Any:
            if device is None:
                return host_memory.for_assign(array)
            return device_memory.to_device(array, device)

        for offset, part in sorted(parts, key=lambda p: p[0]):
            size = len(part) if isinstance(part, bytes) else part.nbytes
            if ready is not None:
                ready(offset + size)
            if isinstance(part, bytes):
                if contents[offset : offset + size] != part:
                    return None
            else:
                values[part] = for_assign(slot_view(buffer, part))
        return [
            (
                group.saveable,
                {
                    slot.key: values[slot]
                    if slot.offset is not None
                    else for_assign(np.zeros(slot.shape, slot.dtype))
                    for slot in group.slots
                },
            )
            for group in self._groups
        ]

    def _ensure_laid_out(self) -> None:
        """Walks the model again if its variables, or the path, changed."""
        if self._fingerprint != fingerprint(self.model) or (
            self._fast != compat.available("fast_weights")
        ):
            self._lay_out()

    def _lay_out(self) -> None:
        self._groups, self._size, self._gaps, self._fast = [], 0, [], False
        self._fingerprint = fingerprint(self.model)
        self.release()
        if not compat.usable("fast_weights"):
            return  # capture() falls back to model.save_weights().
        try:
            with _optimizer_stores_variables(self.model):
                recorded = compat.record_saveables(self.model)
        except Exception as e:  # An internal that moved never stops a backup.
            compat.fail("fast_weights", e)
            return
        groups = [
            _Group(path, metadata, saveable, [_slot(key, v) for key, v in stored])
            for path, metadata, saveable, stored in recorded
        ]
        # Last, so that a restore applies it after Keras' own groups.
        stored_as_is = {id(v) for *_, stored in recorded for _, v in stored}
        exact = ExactValues.of(self.model, lambda v: id(v) not in stored_as_is)
        if exact.variables:
            groups.append(_Group(EXACT_GROUP, None, exact, exact.slots()))
        self._size, self._gaps, offsets = _h5_template(groups)
        for group in groups:
            group.slots = [
                dataclasses.replace(s, offset=offsets.get((group.path, s.key)))
                for s in group.slots
            ]
        self._groups, self._fast = groups, True
        self.release()

    def _read_values(self, raw: bool = False) -> list[Any] | None:
        """Every dataset's current value, in `_data_slots()` order: NumPy
        views, or with `raw` the backend's tensors (on their device)."""
        values = []
        for group in self._groups:
            current = _own_variables(group.saveable)
            if list(current) != [s.key for s in group.slots]:
                return None
            for slot in group.slots:
                if raw:
                    value = device_memory.raw_value(current[slot.key])
                    dtype = keras.backend.standardize_dtype(value.dtype)
                    same = tuple(value.shape) == slot.shape and dtype == slot.dtype.name
                else:
                    value = host_memory.view(current[slot.key])
                    same = value.shape == slot.shape and value.dtype == slot.dtype
                if not same:
                    return None
                if slot.offset is not None:
                    values.append(value)
        return values

    def _data_slots(self) -> list[Slot]:
        return [s for g in self._groups for s in g.slots if s.offset is not None]

    def _chunks_around(self, values: list[np.ndarray]) -> list[Any]:
        """The file's bytes between the values, and the values, in order."""
        pieces = [(offset, gap) for offset, gap in self._gaps]
        for slot, value in zip(self._data_slots(), values, strict=True):
            # As bytes: the buffer protocol knows no bfloat16.
            data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
            pieces.append((slot.offset, data))
        return [piece for _, piece in sorted(pieces, key=lambda p: p[0])]


def _capture_public(model: keras.Model) -> CapturedWeights:
    """The weights file, by `model.save_weights()` into a temporary file.

    The fallback where Keras' saving internals moved: the same file, made
    in the training thread, its bytes then handed to the writer.
    """
    with tempfile.TemporaryDirectory(prefix="keras-ft-save-") as directory:
        path = os.path.join(directory, WEIGHTS_FILE)
        model.save_weights(path)
        # Without Keras' walk, which variables it changes is not known: the
        # own value of every one goes into the exact group.
        exact = ExactValues.of(model, lambda v: True)
        with h5py.File(path, "a") as f:
            group = f.create_group(EXACT_GROUP).create_group("vars")
            for key, variable in exact.store().items():
                group[key] = keras.ops.convert_to_numpy(variable)
        with open(path, "rb") as f:
            captured = CapturedWeights([f.read()])
    captured.non_finite.extend(
        v.path
        for v in saved_variables(model)
        if not finiteness.all_finite(
            np.asarray(keras.ops.convert_to_numpy(v)).reshape(-1)
        )
    )
    return captured


class ExactValues:
    """The own values of some of a model's variables: the exact group.

    Saves and loads like a Keras layer (`save_own_variables()` /
    `load_own_variables()`), keyed by each variable's index in
    `saved_variables()`, so that the weights layout writes and reads it
    like any other group.

    Args:
        variables: `(index in saved_variables(), variable)` pairs.
    """

    def __init__(self, variables: list[tuple[int, Any]]):
        self.variables = variables

    @classmethod
    def of(cls, model: keras.Model, selected: Callable[[Any], bool]) -> ExactValues:
        """The model's saved variables for which `selected` is true."""
        return cls(
            [(i, v) for i, v in enumerate(saved_variables(model)) if selected(v)]
        )

    def store(self) -> dict[str, Any]:
        return {str(i): variable for i, variable in self.variables}

    def slots(self) -> list[Slot]:
        return [_slot(key, variable) for key, variable in self.store().items()]

    def save_own_variables(self, store: Any) -> None:
        store.update(self.store())

    def load_own_variables(self, store: Any) -> None:
        """Assigns each stored value, all checked first: keys, shapes, dtypes."""
        mine = self.store()
        if sorted(store.keys()) != sorted(mine):
            raise ValueError(
                f"The weights file's {EXACT_GROUP!r} group holds the variables "
                f"{sorted(store.keys())}, the model's layout expects {sorted(mine)}."
            )
        values = {key: store[key] for key in mine}
        for key, variable in mine.items():
            value = values[key]
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"The weights file's value for {variable.path!r} has shape "
                    f"{tuple(value.shape)}; the variable has {tuple(variable.shape)}."
                )
        for key, variable in mine.items():
            variable.assign(values[key])


def load_exact(model: keras.Model, path: str) -> None:
    """Applies the exact group of the weights file at `path`, if it has one.

    For the loads that go through `model.load_weights()` (which never reads
    it): afterwards, every variable holds the value it was saved with.
    """
    with h5py.File(path, "r") as f:
        # Only keras-ft's own group: the rest is Keras' file, read by Keras.
        link = f.get(EXACT_GROUP, getlink=True)
        if link is None:
            return
        if not isinstance(link, h5py.HardLink):
            hdf5.check_plain(f, path)  # Raises, naming the link.
        hdf5.check_plain(f[EXACT_GROUP], path)
        group = f.get(f"{EXACT_GROUP}/vars")
        if group is None:
            return
        store = {}
        for key in group:
            dataset = group[key]
            dtype = getattr(dataset, "dtype", None)
            if dtype is not None and dataset.attrs.get("dtype") == "bfloat16":
                store[key] = dataset[()].view(ml_dtypes.bfloat16)
            elif dtype is not None and dtype.kind in _NUMERIC_KINDS:
                store[key] = dataset[()]
            else:
                raise ValueError(
                    f"The weights file {path} holds a non-numeric value "
                    f"{EXACT_GROUP}/vars/{key}."
                )
    load_exact_store(model, store)


def load_exact_store(model: keras.Model, store: dict[str, Any]) -> None:
    """Applies an exact group's `{index: value}` to the model's variables."""
    variables = saved_variables(model)
    indices = [int(key) for key in store if key.isdigit() and key.isascii()]
    ExactValues(
        [(i, variables[i]) for i in indices if i < len(variables)]
    ).load_own_variables(store)


def copy_for_inference(source: str, destination: str) -> None:
    """Copies a backup's weights file as Keras writes it: without the exact
    group, so it holds what `model.save_weights()` would (LoRA merged)."""
    with file_io.pinned(source, file_io.CHECKPOINT_FILE) as pinned:
        _copy_without_exact(pinned, destination)


def _copy_without_exact(source: str, destination: str) -> None:
    with h5py.File(source, "r") as f:
        exact = EXACT_GROUP in f
    if not exact:
        shutil.copyfile(source, destination)
        return
    with h5py.File(source, "r") as f, h5py.File(destination, "w") as out:
        for key, value in f.attrs.items():
            out.attrs[key] = value
        for name in f:
            if name != EXACT_GROUP:
                f.copy(f[name], out, name=name)


def saved_variables(model: keras.Model) -> list:
    """The model's and its optimizer's variables, in the order they are saved."""
    optimizer = getattr(model, "optimizer", None)
    built = optimizer is not None and optimizer.built
    return list(model.weights) + (list(optimizer.variables) if built else [])


def capture(model: keras.Model, copy: bool = True) -> CapturedWeights:
    """The weights file `model.save_weights()` would write, in host memory."""
    return WeightsLayout(model).capture(copy=copy)


@contextlib.contextmanager
def _optimizer_stores_variables(model: keras.Model):
    """Has Keras' optimizer store its variables, not copies, for one walk.

    Its `save_own_variables()` stores `variable.numpy()` of each, a copy of
    the optimizer's whole state, for a walk that only needs shapes.
    """
    optimizer = getattr(model, "optimizer", None)
    if (
        optimizer is None
        or type(optimizer).save_own_variables is not _KERAS_OPTIMIZER_SAVE
    ):
        yield
        return

    def save_own_variables(store: Any) -> None:
        for i, variable in enumerate(optimizer.variables):
            store[str(i)] = variable

    # Around the optimizer's tracking `__setattr__`: a plain instance attribute.
    object.__setattr__(optimizer, "save_own_variables", save_own_variables)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "save_own_variables")


def _own_variables(saveable: Any) -> dict[str, Any]:
    """What `saveable.save_own_variables()` stores, without copying."""
    if type(saveable).save_own_variables is _KERAS_OPTIMIZER_SAVE:
        # Keras' optimizer stores `variable.numpy()`, a copy of each.
        return {str(i): v for i, v in enumerate(saveable.variables)}
    store: dict[str, Any] = {}
    saveable.save_own_variables(store)
    return store


def fingerprint(model: keras.Model) -> tuple:
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = optimizer.variables if optimizer is not None else []
    return (
        tuple(id(v) for v in model.weights),
        tuple(id(v) for v in optimizer_variables),
    )


def _slot(key: str, value: Any) -> Slot:
    # Only the shape and type: a value may be a copy (optimizers make one of
    # each variable), and all of them at once would be a lot.
    array = host_memory.view(value)
    return Slot(key, array.shape, array.dtype, None)


def _h5_template(groups: list[_Group]) -> tuple[int, list, dict]:
    """Lays out an HDF5 file with every group and dataset, data space reserved.

    Returns:
        The file's size; its bytes outside the datasets, as `(offset, bytes)`
        pairs in order; and the byte offset of each `(group, key)` dataset.
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    offsets, extents = {}, []
    # A real (sparse) file: the unwritten data space takes no memory or disk.
    with tempfile.TemporaryDirectory(prefix="keras-ft-layout-") as directory:
        path = os.path.join(directory, "layout.h5")
        with h5py.File(
            path, "w", alignment_threshold=_ALIGN_THRESHOLD, alignment_interval=_ALIGN
        ) as f:
            for group in groups:
                if not group.slots and not group.metadata:
                    continue  # Keras creates no group for a store left unused.
                parent = f.require_group(group.path) if group.path else f
                h5_group = parent.create_group("vars")
                for key, value in (group.metadata or {}).items():
                    h5_group.attrs[key] = value
                for slot in group.slots:
                    dataset = h5_group.create_dataset(
                        slot.key, shape=slot.shape, dtype=slot.dtype, dcpl=dcpl
                    )
                    if slot.dtype == ml_dtypes.bfloat16:
                        dataset.attrs["dtype"] = "bfloat16"
                    if slot.nbytes and dataset.id.get_offset() is None:
                        # h5py allocates scalars late, whatever the property
                        # list says; writing zeros allocates them.
                        dataset[()] = np.zeros(slot.shape, slot.dtype)
                    if slot.nbytes:
                        offset = dataset.id.get_offset()
                        offsets[(group.path, slot.key)] = offset
                        extents.append((offset, offset + slot.nbytes))
        # Space reserved for the last datasets may lie past the end written.
        size = max([os.path.getsize(path)] + [end for _, end in extents])
        gaps, position = [], 0
        with open(path, "rb") as f:
            for start, end in [*sorted(extents), (size, size)]:
                if start > position:
                    gap = os.pread(f.fileno(), start - position, position)
                    gaps.append((position, gap.ljust(start - position, b"\0")))
                position = end
    return size, gaps, offsets
