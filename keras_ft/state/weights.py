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
`load()` maps a file and hands each object views of its values, through its
own `load_own_variables()`; a file the layout itself wrote (recognised by its
bytes outside the values) needs neither parsing nor another walk.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import Any

import h5py
import keras
import ml_dtypes
import numpy as np

from keras_ft import backend as host
from keras_ft import compat
from keras_ft.threads import Watermark

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


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One dataset: a value of one group, and where its bytes lie in the file."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int | None  # None when the value has no bytes.

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass
class _Group:
    """One object's `save_own_variables()`: an HDF5 group `<path>/vars`."""

    path: str
    metadata: dict | None
    saveable: Any
    slots: list[_Slot]


@dataclasses.dataclass
class CapturedWeights:
    """A weights file in host memory: its bytes, as buffers in file order.

    A copy may still be being made: `filled` says how much of its single
    buffer is ready, `fill()` makes the rest, and `written` is for the
    writer to advance as the bytes leave the buffer, which the next copy
    into it waits for. Views of the variables (no copy) have neither.
    """

    chunks: list[Any]
    filled: Watermark | None = None
    written: Watermark | None = None
    # The previous capture's `written`: its write goes to disk first.
    previous: Watermark | None = None
    _fill: Any = dataclasses.field(default=None, repr=False)
    # Filled in by the copy: the datasets holding a NaN or an infinity.
    non_finite: list[str] = dataclasses.field(default_factory=list)

    def fill(self) -> None:
        """Copies the variables into the buffer (in this thread), if not yet."""
        fill, self._fill = self._fill, None
        if fill is not None:
            fill()

    def release(self) -> None:
        """Marks the buffer free for the next copy (its write is over)."""
        if self.written is not None:
            self.written.finish()


class WeightsLayout:
    """What `save_weights()` writes for one model structure, and where.

    Built by one walk of the model (Keras' own traversal, so every layer and
    optimizer is covered); `capture()` reuses it as long as the model has the
    same variables, and walks again when they change.

    Args:
        model: The `keras.Model` whose weights to capture.
    """

    def __init__(self, model: keras.Model):
        self.model = model
        self._fingerprint: tuple | None = None
        self._fast = False  # Laid out by Keras' own walk (not the fallback).
        self._groups: list[_Group] = []
        self._size = 0
        # The file's bytes outside the datasets: (offset, bytes), in order.
        self._gaps: list[tuple[int, bytes]] = []
        self._image: mmap.mmap | None = None
        # How a capture copies the values into the image (`_copy_batches()`).
        self._copy_batches: list[tuple[int, list[_Piece], int]] = []
        self._written: Watermark | None = None  # Of the last copy's write.
        self._allocating: threading.Thread | None = None

    def capture(self, copy: bool = True, fill: bool = True) -> CapturedWeights:
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
                writer must advance (at the latest, finish) its `written`,
                since the next capture's copy of each value waits for it.
                Defaults to `True`.
        """
        self._ensure_laid_out()
        values = self._read_values() if self._fast else None
        if self._fast and values is None:  # Other keys or shapes than planned.
            self._lay_out()
            values = self._read_values() if self._fast else None
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
        self._allocate()
        previous, filled = self._written, Watermark(self._size)
        # Only a capture handed to a writer before it is filled is followed.
        written = self._written = None if fill else Watermark(self._size)
        captured = CapturedWeights(
            [memoryview(self._image)[: self._size]], filled, written, previous
        )
        captured._fill = functools.partial(
            self._fill, values, previous, filled, captured.non_finite
        )
        if fill:
            captured.fill()
        return captured

    def _fill(
        self,
        values: list[np.ndarray],
        previous: Watermark | None,
        filled: Watermark,
        non_finite: list[str],
    ) -> None:
        """Copies `values` into the buffer in file order, raising `filled`.

        Batch by batch: each waits until the previous capture's write has
        passed it, and is copied by this thread and a helper together (the
        training thread waits for the copy anyway; two cores copy faster).
        Each piece is checked for NaN and infinity while it is in the cache;
        the names of the datasets that hold one are added to `non_finite`.
        """
        bad: set[int] = set()
        try:
            for ready, pieces, split in self._copy_batches:
                if previous is not None:
                    previous.wait_for(ready)
                helper = _copy_helper() if 0 < split < len(pieces) else None
                if helper is not None:
                    second = helper.submit(_copy_pieces, values, pieces[split:])
                    bad.update(_copy_pieces(values, pieces[:split]))
                    bad.update(second.result())
                else:
                    bad.update(_copy_pieces(values, pieces))
                filled.advance(ready)
            filled.finish()
        except BaseException as e:
            filled.abandon(e)
            raise
        finally:
            names = self.dataset_names()
            non_finite.extend(names[i] for i in sorted(bad))

    def dataset_names(self) -> list[str]:
        """HDF5 paths of the datasets with bytes, in `_data_slots()` order."""
        return [
            f"{group.path}/vars/{slot.key}".lstrip("/")
            for group in self._groups
            for slot in group.slots
            if slot.offset is not None
        ]

    def prepare(self, copy: bool = True) -> None:
        """Walks the model now rather than at the first capture; with `copy`,
        starts allocating the copy buffer in the background, so that the
        kernel's work of providing its memory overlaps training rather than
        holding it up (for a 600 MB buffer: 0.15-1 s on the VMs measured).
        The first capture waits for it."""
        self._ensure_laid_out()
        if copy and self._fast and self._image is None and self._allocating is None:
            self._allocating = threading.Thread(
                target=self._allocate, name="keras-ft-allocate", daemon=True
            )
            self._allocating.start()

    def _allocate(self) -> None:
        allocating = self._allocating
        if allocating is not None and allocating is not threading.current_thread():
            allocating.join()
            self._allocating = None
        if self._image is not None:
            return
        # Page-aligned, for direct I/O. Private: Python's default is a shared
        # mapping, which the kernel backs with shared memory, slower to touch.
        # Not huge pages: on the VMs measured, asking for them made the first
        # touch 5x slower (compaction). The first touch happens here, not in
        # a save; by NumPy, which lets go of the GIL (`mmap()` with
        # MAP_POPULATE would hold it throughout).
        image = mmap.mmap(-1, max(self._size, 1), flags=mmap.MAP_PRIVATE)
        buffer = np.frombuffer(image, np.uint8)
        buffer[:: mmap.PAGESIZE] = 0
        for offset, gap in self._gaps:
            image[offset : offset + len(gap)] = gap
        self._copy_batches = _copy_batches(self._data_slots(), buffer, self._size)
        self._image, self._written = image, None

    def release(self) -> None:
        """Frees the copy buffer; the next `capture(copy=True)` makes a new one.

        A write still using it keeps it alive until it is done.
        """
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        self._image, self._copy_batches, self._written = None, [], None

    def load_from(self, contents: Any) -> bool:
        """Loads a weights file's bytes into the model, if this layout wrote it.

        Returns:
            `False`, having loaded nothing, for a file laid out otherwise
            (for another model structure, by Keras, or with other names).
        """
        stores = self.values_in(contents)
        if stores is None:
            return False
        _load_stores(stores)
        return True

    def values_in(
        self, contents: Any, ready: Callable[[int], None] | None = None
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

        Returns:
            `(object, store)` pairs, or `None` for a file laid out otherwise.
        """
        self._ensure_laid_out()
        if len(contents) != self._size or not self._size:
            return None  # Also when the fast path is unavailable: no layout.
        buffer = np.frombuffer(contents, np.uint8)
        parts: list[tuple[int, bytes | _Slot]] = [*self._gaps]
        parts += [(s.offset, s) for s in self._data_slots()]
        values: dict[_Slot, Any] = {}
        for offset, part in sorted(parts, key=lambda p: p[0]):
            size = len(part) if isinstance(part, bytes) else part.nbytes
            if ready is not None:
                ready(offset + size)
            if isinstance(part, bytes):
                if contents[offset : offset + size] != part:
                    return None
            else:
                values[part] = host.for_assign(_view(buffer, part))
        return [
            (
                group.saveable,
                {
                    slot.key: values[slot]
                    if slot.offset is not None
                    else host.for_assign(np.zeros(slot.shape, slot.dtype))
                    for slot in group.slots
                },
            )
            for group in self._groups
        ]

    def _ensure_laid_out(self) -> None:
        """Walks the model again if its variables, or the path, changed."""
        if self._fingerprint != _fingerprint(self.model) or (
            self._fast != compat.available("fast_weights")
        ):
            self._lay_out()

    def _lay_out(self) -> None:
        self._groups, self._size, self._gaps, self._fast = [], 0, [], False
        self._fingerprint = _fingerprint(self.model)
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
        self._size, self._gaps, offsets = _h5_template(groups)
        for group in groups:
            group.slots = [
                dataclasses.replace(s, offset=offsets.get((group.path, s.key)))
                for s in group.slots
            ]
        self._groups, self._fast = groups, True
        self.release()

    def _read_values(self) -> list[np.ndarray] | None:
        """Every dataset's current value, in `_data_slots()` order."""
        values = []
        for group in self._groups:
            current = _own_variables(group.saveable)
            if list(current) != [s.key for s in group.slots]:
                return None
            for slot in group.slots:
                value = host.view(current[slot.key])
                if value.shape != slot.shape or value.dtype != slot.dtype:
                    return None
                if slot.offset is not None:
                    values.append(value)
        return values

    def _data_slots(self) -> list[_Slot]:
        return [s for g in self._groups for s in g.slots if s.offset is not None]

    def _chunks_around(self, values: list[np.ndarray]) -> list[Any]:
        """The file's bytes between the values, and the values, in order."""
        pieces = [(offset, gap) for offset, gap in self._gaps]
        for slot, value in zip(self._data_slots(), values, strict=True):
            # As bytes: the buffer protocol knows no bfloat16.
            data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
            pieces.append((slot.offset, data))
        return [piece for _, piece in sorted(pieces, key=lambda p: p[0])]


# A piece of a value to copy: (index in `_data_slots()`, first and last
# element of the flattened value, where in the image those elements go).
_Piece = tuple[int, int, int, np.ndarray]
# Values are copied in pieces of at most this many bytes, gathered into
# batches of at least _COPY_BATCH bytes, after each of which the writer may
# write what is ready.
_COPY_PIECE = 2 * 1024 * 1024
_COPY_BATCH = 8 * 1024 * 1024


def _copy_batches(
    slots: list[_Slot], buffer: np.ndarray, size: int
) -> list[tuple[int, list[_Piece], int]]:
    """The copy of every slot into `buffer`, in file order, as batches.

    Each batch is `(ready, pieces, split)`: once its pieces are copied the
    file's first `ready` bytes are final (the bytes between values never
    change), and `pieces[:split]` and `pieces[split:]` hold about half its
    bytes each, for two threads.
    """
    ordered = sorted(enumerate(slots), key=lambda s: s[1].offset)
    ends = [slot.offset for _, slot in ordered[1:]] + [size]
    batches, pieces, batch_bytes = [], [], 0
    for (index, slot), end in zip(ordered, ends, strict=True):
        flat = _view(buffer, slot).reshape(-1)
        step = max(1, _COPY_PIECE // slot.dtype.itemsize)
        for lo in range(0, flat.size, step):
            hi = min(lo + step, flat.size)
            pieces.append((index, lo, hi, flat[lo:hi]))
            batch_bytes += (hi - lo) * slot.dtype.itemsize
            if batch_bytes >= _COPY_BATCH:
                ready = end if hi == flat.size else slot.offset + hi * flat.itemsize
                batches.append((ready, pieces, _half(pieces)))
                pieces, batch_bytes = [], 0
    if pieces:
        batches.append((size, pieces, _half(pieces)))
    return batches


def _half(pieces: list[_Piece]) -> int:
    """Where to split `pieces` so that each part has about half the bytes."""
    sizes = [destination.nbytes for *_, destination in pieces]
    total, running = sum(sizes), 0
    for i, nbytes in enumerate(sizes):
        if running + nbytes / 2 >= total / 2:
            return i if i else 1
        running += nbytes
    return len(pieces)


def _copy_pieces(values: list[np.ndarray], pieces: list[_Piece]) -> set[int]:
    """Copies `pieces`; returns the indices of values a NaN or inf was seen in."""
    non_finite = set()
    for index, lo, hi, destination in pieces:
        np.copyto(destination, values[index].reshape(-1)[lo:hi], casting="no")
        if index not in non_finite and not _all_finite(destination):
            non_finite.add(index)
    return non_finite


def _all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or infinity; other types always do.

    The sum of an array with a NaN or an infinity is not finite, and one
    pass of summing costs much less than `isfinite()` and its mask; only an
    overflowing sum of finite values needs the exact check.
    """
    if array.dtype.kind != "f" and array.dtype != ml_dtypes.bfloat16:
        return True
    accumulate = np.float32 if array.dtype.itemsize < 4 else None
    if np.isfinite(np.add.reduce(array, dtype=accumulate)):
        return True
    return bool(np.isfinite(array).all())


@functools.cache
def _copy_helper() -> concurrent.futures.ThreadPoolExecutor | None:
    """A second thread for copies, on a machine with more than one core."""
    if (os.cpu_count() or 1) < 2:
        return None
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="keras-ft-copy")


def _capture_public(model: keras.Model) -> CapturedWeights:
    """The weights file, by `model.save_weights()` into a temporary file.

    The fallback where Keras' saving internals moved: the same file, made
    in the training thread, its bytes then handed to the writer.
    """
    with tempfile.TemporaryDirectory(prefix="keras-ft-save-") as directory:
        path = os.path.join(directory, "model.weights.h5")
        model.save_weights(path)
        with open(path, "rb") as f:
            captured = CapturedWeights([f.read()])
    optimizer = model.optimizer
    variables = list(model.weights) + list(optimizer.variables if optimizer else [])
    captured.non_finite.extend(
        v.path
        for v in variables
        if not _all_finite(np.asarray(keras.ops.convert_to_numpy(v)).reshape(-1))
    )
    return captured


def capture(model: keras.Model, copy: bool = True) -> CapturedWeights:
    """The weights file `model.save_weights()` would write, in host memory."""
    return WeightsLayout(model).capture(copy=copy)


def write(path: str, weights: CapturedWeights) -> None:
    """Writes `weights` as a `.weights.h5` file, without fsync."""
    weights.fill()
    try:
        with open(path, "wb") as f:
            f.writelines(weights.chunks)
    finally:
        weights.release()


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
    try:
        mapped = _map(path)
    except OSError:
        return None
    if mapped is None:
        return None
    stores = layout.values_in(mapped, ready)
    if stores is None:
        return None
    return ReadWeights(path, _fingerprint(model), stores, mapped)


def _load_stores(stores: list[tuple[Any, dict]]) -> None:
    errors: dict[int, tuple[Any, Exception]] = {}
    for saveable, store in stores:
        try:
            saveable.load_own_variables(store)
        except Exception as e:  # Reported all together, as Keras does.
            errors[id(saveable)] = (saveable, e)
    if errors:
        compat.raise_loading_failure(errors)


def _map(path: str) -> mmap.mmap | None:
    """`path` mapped copy-on-write and share-locked, or `None` if empty."""
    with open(path, "rb") as f:
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
        and values.fingerprint == _fingerprint(model)
    ):
        _load_stores(values.stores)
        return
    if not compat.usable("fast_weights"):
        model.load_weights(path)
        return
    mapped = _map(path)
    if mapped is None:
        model.load_weights(path)
        return
    if layout is not None and layout.model is model and layout.load_from(mapped):
        return
    size = len(mapped)
    groups = _contiguous_datasets(path, size)
    if groups is None:
        model.load_weights(path)
        return
    buffer = np.frombuffer(mapped, np.uint8)
    views = {
        group: {slot.key: _view(buffer, slot) for slot in slots}
        for group, slots in groups.items()
    }
    compat.load_with_keras_walk(model, views, host.for_assign)


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


def _fingerprint(model: keras.Model) -> tuple:
    optimizer = model.optimizer
    optimizer_variables = optimizer.variables if optimizer is not None else []
    return (
        tuple(id(v) for v in model.weights),
        tuple(id(v) for v in optimizer_variables),
    )


def _view(buffer: np.ndarray, slot: _Slot) -> np.ndarray:
    data = buffer[slot.offset : slot.offset + slot.nbytes]
    return data.view(slot.dtype).reshape(slot.shape)


def _slot(key: str, value: Any) -> _Slot:
    # Only the shape and type: a value may be a copy (optimizers make one of
    # each variable), and all of them at once would be a lot.
    array = host.view(value)
    return _Slot(key, array.shape, array.dtype, None)


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


def _contiguous_datasets(path: str, size: int) -> dict[str, list[_Slot]] | None:
    """Each group's datasets with their offsets, or `None` if any is not
    stored contiguously inside the file (chunked, compressed, external, a
    link, an unknown type), for `model.load_weights()` to deal with."""
    groups: dict[str, list[_Slot]] = {}
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
        dtype = dataset.dtype
        if dataset.attrs.get("dtype") == "bfloat16" and dtype.itemsize == 2:
            dtype = np.dtype(ml_dtypes.bfloat16)
        elif dtype.kind not in _NUMERIC_KINDS:
            plain = False
            return
        slot = _Slot(key, tuple(dataset.shape), dtype, dataset.id.get_offset())
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
        with h5py.File(path, "r") as f:
            f.visititems_links(visit)
    except (OSError, ValueError):
        return None
    return groups if plain else None
