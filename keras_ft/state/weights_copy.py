"""The copy buffer: one host buffer laid out as the weights file, reused.

One snapshot is in flight at a time: a save's copy starts once the last
write from the buffer is over (as Orbax's and DCP's asynchronous saves wait
for the previous one; `benchmarks/overlap.py` measured a copy that followed
the last write piece by piece, and it did not pay 10 %). The copy is made on
two threads (the training thread waits for it anyway; two cores copy
faster), batch by batch, so that the writer can follow it and write each
batch as soon as it is ready. Every value is checked for NaN and infinity
before its bytes are written: a non-finite state is never backed up. The
check is part of the copy, piece by piece while it is in the cache; or, for
a save written in the background, it runs after the copy in a thread of its
own, which the writer follows, so that training waits for the copy alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_ft import threads
from keras_ft.backend.device_memory import pin_host
from keras_ft.backend.finiteness import all_finite
from keras_ft.threads import Watermark


@dataclasses.dataclass(frozen=True)
class Slot:
    """One dataset: a value of one group, and where its bytes lie in the file."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int | None  # None when the value has no bytes.

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def slot_view(buffer: np.ndarray, slot: Slot) -> np.ndarray:
    data = buffer[slot.offset : slot.offset + slot.nbytes]
    return data.view(slot.dtype).reshape(slot.shape)


@dataclasses.dataclass
class CapturedWeights:
    """A weights file in host memory: its bytes, as buffers in file order.

    A copy may still be being made: `filled` says how much of its single
    buffer is ready, and `fill()` makes the rest; `release()` once its write
    is over lets the next copy into the buffer start. Views of the variables
    (no copy) have neither.
    """

    chunks: list[Any]
    # How much of the buffer is ready to write: copied and checked.
    filled: Watermark | None = None
    # Set by `release()`: the next copy into the buffer waits for it.
    free: threading.Event | None = None
    _fill: Any = dataclasses.field(default=None, repr=False)
    # Filled in by the check, before `filled` finishes: the datasets holding
    # a NaN or an infinity.
    non_finite: list[str] = dataclasses.field(default_factory=list)
    # Whether the check follows the copy in the background (`fill()` then
    # returns before `non_finite` is known).
    checked_later: bool = False
    # Whether `fill()` moves a copy made on the device (it may then run in
    # any thread while training goes on).
    from_device: bool = False
    # Set when the save is called off: a move under way stops there (the
    # writer, waiting for `filled`, is told the snapshot was not taken).
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def fill(self) -> None:
        """Copies the variables into the buffer (in this thread), if not yet."""
        fill, self._fill = self._fill, None
        if fill is not None:
            fill()

    def release(self) -> None:
        """Marks the buffer free for the next copy (its write is over)."""
        if self.free is not None:
            self.free.set()


class CopyBuffer:
    """The buffer copies go into, one at a time.

    Args:
        size: The weights file's size.
        gaps: The file's bytes outside the values, as `(offset, bytes)`.
        slots: Where each value lies, in the order `capture()` is given
            the values.
        names: The values' dataset paths, for `non_finite`.
        pools: The threads that help with a copy and check it.
    """

    def __init__(
        self,
        size: int,
        gaps: list[tuple[int, bytes]],
        slots: list[Slot],
        names: list[str],
        pools: threads.Pools,
    ):
        self.size = size
        self._pools = pools
        self._gaps, self._slots, self._names = gaps, slots, names
        self._image: mmap.mmap | None = None
        # How a capture copies the values into the image (`_copy_batches()`).
        self._copy_batches: list[tuple[int, list[_Piece], int]] = []
        # Set once the last copy's write is over (`CapturedWeights.free`).
        self._free: threading.Event | None = None
        self._allocating: threading.Thread | None = None
        self._views: list[np.ndarray] = []  # Each slot's place in the image.
        # A move's order (the slots, in file order), the views in it, and how
        # much of the file is final once each has landed.
        self._move_order: tuple[list[int], list[np.ndarray], list[int]] = ([], [], [])
        # The device the buffer is page-locked for (see `pin()`), and what
        # unlocks it (`_lock()`).
        self._pin_for: Any = None
        self._unpin: Callable[[], None] | None = None
        # Page-locking a buffer takes a while (0.3-1 s for 2.44 GB): done in
        # a thread of its own, which a copy into it never waits for.
        self._pinning: threading.Thread | None = None

    def holds(
        self,
        size: int,
        gaps: list[tuple[int, bytes]],
        slots: list[Slot],
        names: list[str],
    ) -> bool:
        """Whether this buffer holds the file these arguments (as the
        constructor's) lay out: then a later layout of the same model (the
        next fit()'s) can use it as its own."""
        return (self.size, self._gaps, self._slots, self._names) == (
            size,
            gaps,
            slots,
            names,
        )

    def forget_writes(self) -> None:
        """For a buffer taken over by another training (a later fit()):
        every write of the one before is over, and none is to be waited for."""
        self._free = None

    def prepare(self) -> None:
        """Starts allocating the buffer in the background, so that the
        kernel's work of providing its memory overlaps training rather than
        holding it up (for a 600 MB buffer: 0.15-1 s on the VMs measured).
        The first capture waits for it."""
        if self._image is None and self._allocating is None:
            self._allocating = threads.start_daemon(self._allocate, "keras-ft-allocate")

    def pin(self, device: Any, wait: bool = True) -> None:
        """Page-locks the buffer for `device` (`backend.staging_device()`;
        `None`: never), now and whenever it is allocated again: a snapshot on
        the device is moved into it, and a restore reads into it, at the
        bus's speed.

        Args:
            wait: If `False`, locks it in a thread of its own and returns at
                once: a copy taken before that is done goes into the buffer
                as it is (slower, never wrong). Defaults to `True`.
        """
        self._pin_for = device
        if self._image is None or self._unpin is not None or device is None:
            return
        if self._pinning is None:
            buffer = np.frombuffer(self._image, np.uint8)
            self._pinning = threads.start_daemon(
                functools.partial(self._lock, buffer, device), "keras-ft-pin"
            )
        if wait:
            self._pinning.join()

    def _lock(self, buffer: np.ndarray, device: Any) -> None:
        unpin = pin_host(buffer, device)
        if unpin is not None:
            # Unlocked with the buffer, also where it is never released: the
            # driver keeps memory it locked (and its addresses, which a later
            # allocation may be given) until it is unlocked.
            self._unpin = weakref.finalize(self, unpin)

    @property
    def pinned(self) -> bool:
        return self._unpin is not None

    def capture(
        self,
        values: list[np.ndarray] | Callable[[], list[np.ndarray]],
        fill: bool,
        check_later: bool = False,
        move: Callable[[list[np.ndarray]], None] | None = None,
    ) -> CapturedWeights:
        """A copy of `values` in the buffer (see `WeightsLayout.capture()`);
        `values` may be a function that gives them, called by `fill()`.
        With `move`, `values` is ignored: `fill()` calls `move(views,
        stopped, order, landed)` to put every value into its place itself:
        `views` in file order (`order` gives each one's index in `slots`),
        calling `landed(k)` once the k-th has landed; the check and the
        writer follow it. The copy (or move) starts once the last write
        from the buffer is over: one snapshot in flight. A copy that waited
        for that write checks during the copy even with `check_later`
        (`_behind()`)."""
        self._allocate()
        filled = Watermark(self.size)
        # Only a capture handed to a writer before it is filled is waited
        # for: the others are written before the next capture.
        previous, free = self._free, None if fill else threading.Event()
        self._free = free
        check_later = check_later and not _behind(previous)
        captured = CapturedWeights(
            [memoryview(self._image)[: self.size]],
            filled,
            free,
            checked_later=check_later,
        )
        if move is not None:
            captured.checked_later = True
            captured._fill = functools.partial(
                self._move, move, previous, filled, captured.non_finite, captured.stop
            )
        else:
            captured._fill = functools.partial(
                self._fill,
                self._copy_batches,
                values,
                previous,
                filled,
                captured.non_finite,
                check_later,
            )
        if fill:
            captured.fill()
        return captured

    def _fill(
        self,
        batches: list[tuple[int, list[_Piece], int]],
        values: list[np.ndarray] | Callable[[], list[np.ndarray]],
        previous: threading.Event | None,
        filled: Watermark,
        non_finite: list[str],
        check_later: bool,
    ) -> None:
        """Copies `values` into the buffer in file order, once the `previous`
        capture's write is over.

        Batch by batch, each copied by this thread and a helper together (the
        training thread waits for the copy anyway; two cores copy faster).
        Each piece is checked for NaN and infinity while it is in the cache,
        raising `filled` as batches are done; with `check_later`, the check
        is handed to a thread of its own once the copy is made, and it
        raises `filled`. The names of the datasets that hold a NaN or an
        infinity are added to `non_finite` before `filled` finishes.
        """
        bad: set[int] = set()
        try:
            if callable(values):
                values = values()
            if previous is not None:
                previous.wait()
            for ready, pieces, split in batches:
                check = not check_later
                helper = self._pools.copy_helper() if 0 < split < len(pieces) else None
                if helper is not None:
                    second = helper.submit(_copy_pieces, values, pieces[split:], check)
                    bad.update(_copy_pieces(values, pieces[:split], check))
                    bad.update(second.result())
                else:
                    bad.update(_copy_pieces(values, pieces, check))
                if check:
                    filled.advance(ready)
        except BaseException as e:
            filled.abandon(e)
            raise
        if check_later:
            checker = self._pools.checker
            threads.submit(checker, self._check, batches, filled, non_finite)
        else:
            self._finish(filled, non_finite, bad)

    @contextlib.contextmanager
    def staged(self, read: Callable[[memoryview], None]) -> Iterator[memoryview]:
        """The buffer, once the last write from it is over, holding what
        `read(buffer)` put there (a weights file, for a restore to move to
        the device from page-locked memory). The bytes between the values
        are the layout's own again on exit: the next save's copy only fills
        in the values."""
        self._allocate()
        if self._free is not None:
            self._free.wait()
        image = memoryview(self._image)[: self.size]
        try:
            read(image)
            yield image
        finally:
            for offset, gap in self._gaps:
                image[offset : offset + len(gap)] = gap

    def _move(
        self,
        move: Callable[..., bool],
        previous: threading.Event | None,
        filled: Watermark,
        non_finite: list[str],
        stop: threading.Event,
    ) -> None:
        """`move()` into the buffer in file order once the `previous`
        capture's write is over, with the check in a thread of its own
        following it, and the writer following the check; none once `stop`
        is set."""
        order, views, ends = self._move_order
        moved = Watermark(self.size)
        batches = self._copy_batches
        threads.submit(
            self._pools.checker, self._check, batches, filled, non_finite, moved
        )
        try:
            if previous is not None:
                previous.wait()
            if stop.is_set() or not move(
                views, stop.is_set, order, lambda k: moved.advance(ends[k])
            ):
                moved.abandon(threads.Cancelled("the save was called off"))
                return
        except BaseException as e:
            moved.abandon(e)
            raise
        moved.finish()

    def _check(
        self,
        batches: list[tuple[int, list[_Piece], int]],
        filled: Watermark,
        non_finite: list[str],
        moved: Watermark | None = None,
    ) -> None:
        """Checks a copy made (or being `moved` into the buffer), batch by
        batch, raising `filled` as it goes."""
        bad: set[int] = set()
        try:
            for ready, pieces, _ in batches:
                if moved is not None:
                    moved.wait_for(ready)
                bad.update(_non_finite_pieces(pieces))
                filled.advance(ready)
        except BaseException as e:
            filled.abandon(e)
            raise
        self._finish(filled, non_finite, bad)

    def _finish(self, filled: Watermark, non_finite: list[str], bad: set[int]) -> None:
        # The names first: a writer that sees `filled` finish reads them.
        non_finite.extend(self._names[i] for i in sorted(bad))
        filled.finish()

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
        image = mmap.mmap(-1, max(self.size, 1), flags=mmap.MAP_PRIVATE)
        buffer = np.frombuffer(image, np.uint8)
        buffer[:: mmap.PAGESIZE] = 0
        for offset, gap in self._gaps:
            image[offset : offset + len(gap)] = gap
        self._copy_batches = _copy_batches(self._slots, buffer, self.size)
        self._views = [slot_view(buffer, slot) for slot in self._slots]
        # Once a value has landed, the file is final up to the next one's place.
        order = sorted(range(len(self._slots)), key=lambda i: self._slots[i].offset)
        offsets = [self._slots[i].offset for i in order]
        views = [self._views[i] for i in order]
        self._move_order = (order, views, offsets[1:] + [self.size])
        if self._pin_for is not None:
            self._lock(buffer, self._pin_for)
        self._image, self._free = image, None

    def release(self) -> None:
        """Frees the buffer; the next capture allocates a new one.

        A write still using it keeps it alive until it is done.
        """
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        if self._unpin is not None:
            # A save's move is over (it is waited for before the next
            # snapshot and at close): nothing is in flight into it.
            self._unpin()
            self._unpin = None
        self._image, self._copy_batches, self._free = None, [], None
        self._views, self._move_order = [], ([], [], [])


def _behind(previous: threading.Event | None) -> bool:
    """Whether a copy starts behind the last write from the buffer (saves
    back to back): it waits for the disk anyway, and a check after it would
    compete with the next write for the cores. It then checks each piece
    during the copy, while it is in the cache: saving every batch of a
    5M-parameter MLP on 2 cores, that adds about a fifth less time a save
    (`benchmarks/check_in_copy.py`)."""
    return previous is not None and not previous.is_set()


# A piece of a value to copy: (index in `_data_slots()`, first and last
# element of the flattened value, where in the image those elements go).
_Piece = tuple[int, int, int, np.ndarray]
# Values are copied in pieces of at most this many bytes, gathered into
# batches of at least _COPY_BATCH bytes, after each of which the writer may
# write what is ready.
_COPY_PIECE = 2 * 1024 * 1024
_COPY_BATCH = 8 * 1024 * 1024


def _copy_batches(
    slots: list[Slot], buffer: np.ndarray, size: int
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
        flat = slot_view(buffer, slot).reshape(-1)
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


def _copy_pieces(
    values: list[np.ndarray], pieces: list[_Piece], check: bool = True
) -> set[int]:
    """Copies `pieces`; with `check`, returns the indices of the values a NaN
    or an infinity was seen in (else an empty set). Each piece is checked
    right after its copy, while it is in the cache."""
    non_finite = set()
    for index, lo, hi, destination in pieces:
        np.copyto(destination, values[index].reshape(-1)[lo:hi], casting="no")
        if check and index not in non_finite and not all_finite(destination):
            non_finite.add(index)
    return non_finite


def _non_finite_pieces(pieces: list[_Piece]) -> set[int]:
    """The indices of the values whose copied pieces hold a NaN or an infinity."""
    non_finite = set()
    for index, _, _, destination in pieces:
        if index not in non_finite and not all_finite(destination):
            non_finite.add(index)
    return non_finite
