"""Sharded checkpoints: every process writes the pieces of the variables it holds.

Under `keras.distribution.ModelParallel` over several JAX processes, a kernel
is split across devices of several processes: to write it whole, one process
would have to gather it, so its memory and time would grow with the whole
model. Instead each process writes the pieces it addresses (one copy of each,
its replica 0) into its own file, and one process commits:

```
chief/.parts-<save>/shards-00001.bin   a process's pieces, back to back
chief/.parts-<save>/shards-00001.json  their index, written (renamed) last
```

The chief's commit waits until every process's index is there, moves the
`.bin` files into its staging directory, writes `shards.json` (each
variable's global shape, dtype and layout, and each piece's file, offset,
bounds and checksum) with the rest of the checkpoint, and commits it by the
rename every checkpoint is committed by. Until then no reader sees any of
it: a kill of any process at any moment leaves the previous checkpoint the
newest. No collective runs in the writers, so saves stay in the background.

A restore reads, for each device of the run being restored (any number of
processes, any mesh, or one process without a distribution), only the
pieces that overlap the slice that device holds, checks each piece's
checksum before using it, and builds the variable in its current layout.
The manifest lists each `.bin` file's size and checksum too, marked as
checked piece by piece: a restore skips the whole-file pass, `keras-ft
verify` does not.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import mmap
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. as NumPy dtypes)
import numpy as np

from keras_ft import threads
from keras_ft.backend import cross_process, device_memory, finiteness
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import PIECEWISE
from keras_ft.checkpoint.parts import Parts
from keras_ft.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ProcessesDisagreeError,
    SaveCancelled,
)

# A shards table lists every variable's pieces: far below this.
_MAX_TABLE_BYTES = 256 << 20

SHARDS_TABLE = "shards.json"
TABLE_FORMAT = "keras-ft-shards"
# How long the chief's commit waits for the other processes' pieces.
WAIT_ENV = "KERAS_FT_SHARD_WAIT_SECONDS"
_WAIT_SECONDS = 600.0
_ALIGN = 64  # Each piece starts on a cache line: aligned views on restore.
# How many bytes of pieces a restore from a bucket fetches ahead of the one
# it places: ranged GETs in parallel, memory bounded.
_AHEAD_BYTES = 256 << 20
# Pieces of one file that lie at most _RUN_GAP bytes apart are fetched by one
# ranged GET of up to _RUN_BYTES (more if one piece is bigger): every request
# has a fixed cost (a round trip; some servers read the whole object for each
# range), and 8-16 MB ranges are what object stores serve fastest in parallel.
_RUN_GAP = 64 << 10
_RUN_BYTES = 16 << 20


@dataclasses.dataclass
class Piece:
    """One slice of one variable, in host memory.

    Attributes:
        variable: The variable's index in the saved order.
        start: First index of the slice, per dimension.
        stop: End of the slice (exclusive), per dimension.
        data: The values.
        offset: Where they lie in the process's file.
        first: Whether this process holds the piece's first replica: of
            all processes, only that one writes it into a shared save.
    """

    variable: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    data: np.ndarray
    offset: int = 0
    first: bool = True


class Share:
    """A process's pieces, copied back to back into one page-aligned buffer
    laid out as its file: one sequential write, direct I/O where the
    filesystem allows it, and the same memory for every save.

    Args:
        layout: `(variable, start, stop, dtype, first)` of each piece.
    """

    def __init__(self, layout: list[tuple[int, tuple, tuple, np.dtype, bool]]):
        self.layout = layout
        offsets, size = [], 0
        for _, start, stop, dtype, _ in layout:
            size += -size % _ALIGN
            offsets.append(size)
            size += _volume(start, stop) * np.dtype(dtype).itemsize
        self.size = size
        # Anonymous memory: page-aligned, and its pages are the process's
        # own share, never another copy of the variables.
        self._buffer = mmap.mmap(-1, max(size, 1))
        whole = np.frombuffer(self._buffer, np.uint8)
        self.pieces = [
            Piece(
                variable,
                start,
                stop,
                whole[offset : offset + _volume(start, stop) * np.dtype(dtype).itemsize]
                .view(dtype)
                .reshape([b - a for a, b in zip(start, stop, strict=True)]),
                offset,
                first,
            )
            for (variable, start, stop, dtype, first), offset in zip(
                layout, offsets, strict=True
            )
        ]

    @classmethod
    def copy_of(
        cls,
        values: list[tuple[int, tuple, tuple, np.ndarray]],
        reuse: Share | None = None,
    ) -> Share:
        """A share holding a copy of `values`, `(variable, start, stop, array)`
        or `(variable, start, stop, array, first)`; in `reuse`'s memory if it
        has the same layout (it must be written out by now)."""
        layout = [
            (v[0], v[1], v[2], v[3].dtype, v[4] if len(v) > 4 else True) for v in values
        ]
        share = reuse if reuse is not None and reuse.layout == layout else cls(layout)
        for piece, value in zip(share.pieces, values, strict=True):
            np.copyto(piece.data, value[3])
        return share

    @property
    def all_first(self) -> bool:
        """Whether every piece is one this process writes into a shared save."""
        return all(p.first for p in self.pieces)

    def image(self) -> memoryview:
        """The file's bytes."""
        return memoryview(self._buffer)[: self.size]


def is_sharded(variables: list) -> bool:
    """Whether a save of `variables` must be sharded: one spans processes."""
    return cross_process.any_spans_processes(variables)


def take_share(
    variables: list, reuse: Share | None = None, every_replica: bool = False
) -> Share:
    """Copies this process's pieces of `variables` to host memory (see
    `Share.copy_of()` for `reuse`): those it writes into a shared save, or
    with `every_replica` all it holds (for a save of its own)."""
    if not every_replica:
        values = [
            (i, start, stop, view, True)
            for i, variable in enumerate(variables)
            for (start, stop), view in cross_process.own_pieces(variable)
        ]
    else:
        values = [
            (i, start, stop, view, first)
            for i, variable in enumerate(variables)
            for (start, stop), view, first in cross_process.held_pieces(variable)
        ]
    return Share.copy_of(values, reuse)


def move_share(
    copies: list, reuse: Share | None = None, every_replica: bool = False
) -> Share:
    """`take_share()` of `copies` (of the variables, from
    `backend.device_snapshot()`), moved to host memory by
    `backend.move_to_host()`: straight into the share's buffer, in pieces
    with their transfers overlapped. Empties `copies`, so that each
    device buffer goes as soon as it is moved."""
    sources, layout = [], []
    for i in range(len(copies)):
        for (start, stop), data, first in cross_process.held_shards(copies[i]):
            if first or every_replica:
                sources.append(data)
                layout.append((i, start, stop, np.dtype(data.dtype), first))
        copies[i] = None
    share = reuse if reuse is not None and reuse.layout == layout else Share(layout)
    device_memory.move_to_host(sources, [piece.data for piece in share.pieces])
    return share


def non_finite(share: Share, names: list[str]) -> list[str]:
    """Names of the variables of which a piece holds a NaN or an infinity."""
    bad = {
        p.variable
        for p in share.pieces
        if not finiteness.all_finite(p.data.reshape(-1))
    }
    return [names[i] for i in sorted(bad)]


def part_name(process: int) -> str:
    return f"shards-{process:05d}"


def _part_image(share: Share) -> tuple[list[Any], list[dict]]:
    """The file of this process's part of a shared save, as buffers to
    write back to back, and its index: the pieces it writes (`first`). The
    share's own image when those are all of its pieces (no other copy)."""
    if share.all_first:
        return [share.image()], _piece_index(share.pieces)
    chunks: list[Any] = []
    pieces, size = [], 0
    for piece in share.pieces:
        if not piece.first:
            continue  # Another process writes it.
        if size % _ALIGN:
            chunks.append(bytes(-size % _ALIGN))
            size += -size % _ALIGN
        chunks.append(piece.data.reshape(-1).view(np.uint8))
        pieces.append(dataclasses.replace(piece, offset=size))
        size += piece.data.nbytes
    return chunks, _piece_index(pieces)


def _piece_index(pieces: list[Piece]) -> list[dict]:
    """Where each of `pieces` lies in its file, with its checksum."""
    index = []
    for piece in pieces:
        digest = file_io.DIGESTS[file_io.DIGEST]()
        digest.update(piece.data.reshape(-1).view(np.uint8))
        index.append(
            {
                "variable": piece.variable,
                "start": list(piece.start),
                "stop": list(piece.stop),
                "dtype": piece.data.dtype.name,
                "offset": piece.offset,
                "nbytes": piece.data.nbytes,
                file_io.DIGEST: digest.hexdigest(),
            }
        )
    return index


def _index_bytes(process: int, tag: str, entry: dict, pieces: list[dict]) -> bytes:
    name = part_name(process)
    body = {"tag": tag, "process": process, "file": f"{name}.bin", "entry": entry}
    return json.dumps({**body, "pieces": pieces}).encode("utf-8")


def write_part(
    parts: Parts,
    process: int,
    tag: str,
    share: Share,
    cancel: threading.Event | None = None,
    hasher: threads.Pool | None = None,
) -> None:
    """Writes this process's pieces into `parts` (its storage's place for
    the save's parts) and, last, their index: its part is done. `hasher`
    checksums the data as it is written (see `files.write_file()`)."""
    name = part_name(process)
    chunks, pieces = _part_image(share)
    entry = parts.write_data(f"{name}.bin", chunks, cancel, hasher)
    parts.write_index(f"{name}.json", _index_bytes(process, tag, entry, pieces))


def write_own_part(
    staging: Staging,
    process: int,
    tag: str,
    share: Share,
    specs: list[list],
    layouts: list[str],
) -> None:
    """Writes a save of this process's own: every piece it holds (taken with
    `every_replica`), and a table of them alone. Enough to rebuild this
    process's slices in the same layout, no other's (a local tier)."""
    name = f"{part_name(process)}.bin"
    staging.write_file(name, [share.image()])
    staging.digests[name] = {**staging.digests[name], PIECEWISE: True}
    index = {"tag": tag, "process": process, "file": name}
    index["pieces"] = _piece_index(share.pieces)
    _write_table(staging, [index], specs, layouts, whole=False)


def wait_for_parts(
    parts: Parts,
    processes: int,
    tag: str,
    cancel: threading.Event | None = None,
    timeout: float | None = None,
    read: Callable[[int], bytes | None] | None = None,
) -> list[dict]:
    """Every process's index of the save `tag` in `parts`, once all are
    written.

    Args:
        read: How to read a process's index; `None` if it is not there yet.
            Defaults to reading it from `parts`.

    Raises:
        ProcessesDisagreeError: naming the processes whose part is missing
            after `timeout`, or if an index belongs to another save.
        SaveCancelled: if `cancel` is set while waiting.
    """
    if timeout is None:
        timeout = float(os.environ.get(WAIT_ENV, _WAIT_SECONDS))
    if read is None:

        def read(process: int) -> bytes | None:
            return parts.read_index(f"{part_name(process)}.json", _MAX_TABLE_BYTES)

    deadline = time.monotonic() + timeout
    found: dict[int, dict] = {}
    pause = 0.002
    while True:
        for process in range(processes):
            if process not in found:
                index = _index_of(parts.where, process, tag, read(process))
                if index is not None:
                    found[process] = index
        if len(found) == processes:
            return [found[p] for p in range(processes)]
        if cancel is not None and cancel.is_set():
            raise SaveCancelled(f"The sharded save into {parts.where} was called off.")
        if time.monotonic() > deadline:
            missing = sorted(set(range(processes)) - set(found))
            raise ProcessesDisagreeError(
                f"Processes {missing} did not write their part of the save into "
                f"{parts.where} within {timeout:.0f} s (set {WAIT_ENV} to wait "
                "longer); this save is not committed."
            )
        time.sleep(pause)
        pause = min(pause * 2, parts.poll_seconds)


def _index_of(where: str, process: int, tag: str, data: bytes | None) -> dict | None:
    """A process's index of its part of the save `tag`, read as `data`;
    `None` if it is not there yet."""
    if data is None:
        return None
    where = f"{where}/{part_name(process)}.json"
    try:
        index = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ProcessesDisagreeError(f"{where} is unreadable ({e})") from None
    if not isinstance(index, dict):
        raise ProcessesDisagreeError(f"{where} is not an index of pieces")
    if index.get("tag") != tag or index.get("process") != process:
        raise ProcessesDisagreeError(
            f"{where} belongs to another save ({index.get('tag')!r}, "
            f"not {tag!r}); the processes of this training disagree "
            "on which save this is."
        )
    return index


def commit_parts(
    staging: Staging,
    parts: Parts,
    processes: int,
    tag: str,
    specs: list[list],
    layouts: list[str],
) -> None:
    """The chief's side of a sharded save: waits until every process's part
    of the save `tag` is in `parts`, makes them files of the checkpoint
    `staging` becomes, and writes `shards.json`, the table of every piece
    of every variable (`specs`: `[group, path, shape, dtype]` of each;
    `layouts`: how each is laid out, `backend.sharding_text()`).

    Raises:
        ProcessesDisagreeError: if a part is missing, belongs to another
            save or is malformed, or if the pieces do not cover every
            variable exactly once. What the processes wrote is then
            removed: a failed or called-off save commits nothing.
    """
    indexes_read: dict[int, bytes] = {}  # Each index as written.

    def read(process: int) -> bytes | None:
        data = parts.read_index(f"{part_name(process)}.json", _MAX_TABLE_BYTES)
        if data is not None:
            indexes_read[process] = data
        return data

    try:
        indexes = wait_for_parts(parts, processes, tag, staging.cancel, read=read)
        for process, index in enumerate(indexes):
            name = part_name(process)
            if index.get("file") != f"{name}.bin":
                raise ProcessesDisagreeError(
                    f"{parts.where}/{name}.json names {index.get('file')!r}, not "
                    f"{name}.bin"
                )
            parts.adopt(staging, f"{name}.bin", index["entry"])
            parts.adopt_index(staging, f"{name}.json", indexes_read[process])
        _write_table(staging, indexes, specs, layouts)
    except (KeyError, TypeError, ValueError) as e:  # An index of another shape.
        parts.discard()
        raise ProcessesDisagreeError(
            f"{parts.where}: an index of pieces is malformed ({type(e).__name__}: "
            f"{e}); this save is not committed."
        ) from None
    except BaseException:
        # What did arrive is removed: a failure before the commit (whose
        # own failure removes it too) leaves no partial checkpoint behind.
        parts.discard()
        raise
    finally:
        parts.close()


def _write_table(
    staging: Staging,
    indexes: list[dict],
    specs: list[list],
    layouts: list[str],
    whole: bool = True,
) -> None:
    """Writes `shards.json`, the table of every piece of every variable
    (`whole`), or of one process's pieces only."""
    variables = [
        {
            "path": path,
            "group": group,
            "shape": list(shape),
            "dtype": dtype,
            "layout": layout,
            "pieces": [],
        }
        for (group, path, shape, dtype), layout in zip(specs, layouts, strict=True)
    ]
    for index in indexes:
        name = index["file"]
        for piece in index["pieces"]:
            entry = {k: v for k, v in piece.items() if k != "variable"}
            variables[piece["variable"]]["pieces"].append({"file": name, **entry})
    for variable in variables if whole else ():
        covered = sum(_volume(p["start"], p["stop"]) for p in variable["pieces"])
        if covered != math.prod(variable["shape"]):
            raise ProcessesDisagreeError(
                f"The processes' pieces of {variable['path']!r} cover {covered} "
                f"of its {math.prod(variable['shape'])} values; this save is "
                "not committed."
            )
    table = {
        "format": TABLE_FORMAT,
        "processes": len(indexes),
        "variables": variables,
        # Which save it is: every process must restore the same one.
        "save": indexes[0]["tag"] if indexes else None,
    }
    staging.write_file(SHARDS_TABLE, [json.dumps(table).encode("utf-8")])


def is_sharded_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, SHARDS_TABLE))


class ShardedReader:
    """Reads slices of the variables of a sharded checkpoint.

    Each piece's checksum is checked whenever it is read; a slice is put
    together from the pieces that overlap it. `close()` when done.

    Args:
        directory: The checkpoint.
        specs: `[group, path, shape, dtype]` of the variables to read, in
            the model's order; the checkpoint must hold the same first (a
            model without its optimizer reads the model's variables only).
        ranges: How to read byte ranges of files left in a bucket
            (`Checkpoint.ranges` of a local copy); `None` reads `directory`.

    Raises:
        CorruptCheckpointError: if `shards.json` is unreadable or does not
            describe these variables.
    """

    def __init__(
        self,
        directory: str,
        specs: list[list],
        ranges: Callable[[str, int, int], bytes] | None = None,
    ):
        self.directory = directory
        path = os.path.join(directory, SHARDS_TABLE)
        try:
            data = file_io.read_regular(
                path, _MAX_TABLE_BYTES, depth=file_io.CHECKPOINT_FILE
            )
            table = json.loads(data)
        except (OSError, ValueError, RecursionError) as e:
            raise CorruptCheckpointError(directory, f"{SHARDS_TABLE}: {e}") from None
        if not isinstance(table, dict):
            raise CorruptCheckpointError(directory, f"{SHARDS_TABLE} is malformed")
        variables = table.get("variables")
        if table.get("format") != TABLE_FORMAT or not isinstance(variables, list):
            raise CorruptCheckpointError(directory, f"{SHARDS_TABLE} is malformed")
        if len(variables) < len(specs) or any(
            list(v.get("shape", ())) != list(s[2])
            for v, s in zip(variables[: len(specs)], specs, strict=True)
        ):
            raise CorruptCheckpointError(
                directory, f"{SHARDS_TABLE} does not list the variables of metadata"
            )
        self._variables = variables
        save = table.get("save")
        self.save = save if isinstance(save, str) else None
        self._files: dict[str, int] = {}  # Open descriptors, by name.
        self._lock = threading.Lock()
        # A bucket's checkpoint: its files' pieces are fetched by range.
        self._ranges = ranges
        # Runs of pieces being fetched ahead from the bucket, by piece (with
        # the piece's place in its run), and the runs to fetch next.
        self._fetching: dict[tuple[str, int, int], tuple[_Run, int]] = {}
        self._queued: collections.deque[_Run] = collections.deque()
        self._ahead = 0  # Bytes being fetched.
        self._transfers = threads.Pool(threads.TRANSFERS, "keras-ft-transfer")

    def read(self, variable: int, bounds: cross_process.Bounds) -> np.ndarray:
        """The slice `bounds` (start, stop) of the variable at `variable`."""
        spec = self._variables[variable]
        start, stop = bounds
        dtype = np.dtype(spec["dtype"])
        for piece in spec["pieces"]:
            if tuple(piece["start"]) == tuple(start) and tuple(piece["stop"]) == (
                tuple(stop)
            ):
                # The same layout as saved: the piece itself, not a copy.
                return self._piece(piece, dtype)
        out = np.empty([b - a for a, b in zip(start, stop, strict=True)], dtype)
        filled = 0
        for piece, low, high in _overlapping(spec["pieces"], start, stop):
            values = self._piece(piece, dtype)
            source = tuple(
                slice(lo - p, hi - p)
                for lo, hi, p in zip(low, high, piece["start"], strict=True)
            )
            target = tuple(
                slice(lo - s, hi - s)
                for lo, hi, s in zip(low, high, start, strict=True)
            )
            out[target] = values[source]
            filled += _volume(low, high)
        if filled != out.size:
            raise CorruptCheckpointError(
                self.directory,
                f"the pieces of {spec['path']!r} do not cover {list(start)}:"
                f"{list(stop)}",
            )
        return out

    def missing(self, needs: list[list[cross_process.Bounds]]) -> str | None:
        """The first of the slices `needs[i]` of the variable at `i` that the
        checkpoint's pieces do not cover, as text; `None` if they cover all.
        Reads the table only (a local tier holds one process's pieces: those
        of the layout it was saved in)."""
        for spec, slices in zip(self._variables, needs, strict=False):
            for start, stop in slices:
                covered = sum(
                    _volume(low, high)
                    for _, low, high in _overlapping(spec["pieces"], start, stop)
                )
                if covered != _volume(list(start), list(stop)):
                    return f"{spec['path']!r} [{list(start)}:{list(stop)}]"
        return None

    def read_ahead(self, needs: list[list[cross_process.Bounds]]) -> None:
        """From a bucket, starts fetching every piece the slices `needs[i]`
        of the variable at `i` overlap, up to `_AHEAD_BYTES` of ranged GETs
        at once, so that `read()` finds each in memory as it checks and
        places the one before. From disk, nothing: the kernel reads ahead
        (telling it every piece up front measured slower here)."""
        if self._ranges is None:
            return
        wanted: dict[tuple[str, int, int], None] = {}
        for spec, slices in zip(self._variables, needs, strict=False):
            for piece in spec["pieces"]:
                key = _key(piece)
                if key is not None and any(_overlaps(piece, b) for b in slices):
                    wanted[key] = None
        self._queued.extend(_runs(list(wanted)))
        self._fetch_more()

    def _fetch_more(self) -> None:
        while self._queued and (not self._fetching or self._ahead < _AHEAD_BYTES):
            run = self._queued.popleft()
            run.bytes = threads.submit(
                self._transfers, self._fetch, run.name, run.offset, run.nbytes
            )
            for key in run.pieces:
                self._fetching[key] = (run, key[1] - run.offset)
            run.left = len(run.pieces)
            self._ahead += run.nbytes

    def _piece(self, piece: dict, dtype: np.dtype) -> np.ndarray:
        name, offset, nbytes = piece["file"], piece["offset"], piece["nbytes"]
        shape = [b - a for a, b in zip(piece["start"], piece["stop"], strict=True)]
        if np.dtype(piece["dtype"]) != dtype or nbytes != math.prod(shape) * (
            dtype.itemsize
        ):
            raise CorruptCheckpointError(
                self.directory, f"a piece in {name} has the wrong size or type"
            )
        if offset < 0:
            raise CorruptCheckpointError(self.directory, f"{name} is too short")
        if self._ranges is not None:
            fetching = self._fetching.pop((name, offset, nbytes), None)
            if fetching is None:
                raw = self._fetch(name, offset, nbytes)
            else:
                run, at = fetching
                assert run.bytes is not None
                raw = run.bytes.result()[at : at + nbytes]
                run.left -= 1
                if not run.left:  # Its bytes are the pieces' now.
                    self._ahead -= run.nbytes
                    self._fetch_more()
        else:
            with self._lock:
                fd = self._files.get(name)
                if fd is None:
                    fd = self._files[name] = _open(self.directory, name)
            # Read, not mapped: from disk, faulting a mapping's pages in ran
            # 3-4x slower here (a save's direct I/O leaves nothing cached).
            raw = np.empty(nbytes, np.uint8)
            if os.preadv(fd, [raw], offset) != nbytes:
                raise CorruptCheckpointError(self.directory, f"{name} is too short")
        digest = file_io.DIGESTS[file_io.DIGEST]()
        digest.update(raw)
        if digest.hexdigest() != piece.get(file_io.DIGEST):
            raise CorruptCheckpointError(
                self.directory,
                f"a piece of {name} (bytes {offset} to {offset + nbytes}) "
                "does not match its checksum",
            )
        return raw.view(dtype).reshape(shape)

    def _fetch(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        """The piece's bytes from the bucket: one ranged GET, no more."""
        _check_name(self.directory, name)
        try:
            data = self._ranges(name, offset, nbytes)
        except FileNotFoundError:
            raise CorruptCheckpointError(self.directory, f"{name} is missing") from None
        except OSError as e:
            raise CorruptCheckpointError(
                self.directory, f"{name} could not be read ({e})"
            ) from None
        if len(data) != nbytes:
            raise CorruptCheckpointError(self.directory, f"{name} is too short")
        # Writable, as a read from disk is (a framework may keep the array).
        return np.frombuffer(data, np.uint8).copy()

    def close(self) -> None:
        self._queued.clear()
        self._fetching.clear()
        # The GETs not begun are called off; those under way end, their
        # bytes dropped.
        self._transfers.close()
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()


@dataclasses.dataclass(eq=False)
class _Run:
    """Pieces of one file fetched from a bucket by one ranged GET."""

    name: str
    offset: int
    nbytes: int
    pieces: list[tuple[str, int, int]]
    left: int = 0  # Pieces not yet read from it, once started.
    bytes: Future | None = None  # Of the GET, once started.


def _runs(keys: list[tuple[str, int, int]]) -> list[_Run]:
    """The pieces `keys` (file, offset, bytes) as runs to fetch, in the
    order their first piece is needed. Only pieces in file order, apart by
    at most _RUN_GAP, join a run, up to _RUN_BYTES: a table's offsets are
    untrusted, and overlapping or far-apart pieces are fetched alone."""
    order = {key: i for i, key in enumerate(keys)}
    runs: list[tuple[int, _Run]] = []
    for key in sorted(keys):  # By file, then offset.
        name, offset, nbytes = key
        last = runs[-1][1] if runs else None
        end = last.offset + last.nbytes if last is not None else 0
        if (
            last is not None
            and last.name == name
            and end <= offset <= end + _RUN_GAP
            and offset + nbytes - last.offset <= _RUN_BYTES
        ):
            last.nbytes = offset + nbytes - last.offset
            last.pieces.append(key)
            runs[-1] = (min(runs[-1][0], order[key]), last)
        else:
            runs.append((order[key], _Run(name, offset, nbytes, [key])))
    return [run for _, run in sorted(runs, key=lambda r: r[0])]


def read_variables(
    directory: str,
    variables: list,
    specs: list[list],
    ranges: Callable[[str, int, int], bytes] | None = None,
) -> list[Any]:
    """Each of `variables`' values from the checkpoint, in its own layout
    (`ranges`: see `ShardedReader`).

    Every process of a cluster calls this together: the processes agree
    that each read its pieces intact before any value is returned.

    Raises:
        CorruptCheckpointError: on every process, if a piece any process
            needed is damaged.
    """
    error: BaseException | None = None
    values: list[Any] = []
    reader = None
    try:
        reader = ShardedReader(directory, specs, ranges)
        reader.read_ahead(
            [
                cross_process.bounds_needed(variable, tuple(spec[2]))
                for variable, spec in zip(variables, specs, strict=True)
            ]
        )
        for i, (variable, spec) in enumerate(zip(variables, specs, strict=True)):
            values.append(
                cross_process.build_like(
                    variable, tuple(spec[2]), _reader_of(reader, i)
                )
            )
    except (CorruptCheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        error = e
    finally:
        if reader is not None:
            reader.close()
    agreed = cross_process.all_processes_agree(error is None)
    # Each process found its newest checkpoint itself: they must be the same
    # save (its tag; in a local tier, each process reads a file of its own).
    save = reader.save if reader is not None and reader.save else None
    name = save or os.path.basename(os.path.normpath(directory))
    same = cross_process.same_in_all_processes(zlib.crc32(name.encode()))
    if agreed and not same:
        raise CheckpointError(
            f"The processes of this training found different newest checkpoints "
            f"(this one: {directory}); was one started before the previous run's "
            "last commit? Start the processes of a run once every process of the "
            "previous one has ended."
        )
    if error is not None:
        if isinstance(error, CorruptCheckpointError):
            raise error
        raise CorruptCheckpointError(directory, f"{type(error).__name__}: {error}")
    if not agreed:
        raise CorruptCheckpointError(
            directory, "another process found a damaged piece of it"
        )
    return values


def missing_in(directory: str, variables: list, specs: list[list]) -> str | None:
    """What this process's devices need of `variables` that the sharded
    checkpoint `directory` does not hold (see `ShardedReader.missing()`), or
    `None`. Reads its table only; no collective.

    Raises:
        CorruptCheckpointError: if its table is unreadable or malformed.
    """
    reader = ShardedReader(directory, specs)
    try:
        return reader.missing(
            [
                cross_process.bounds_needed(variable, tuple(spec[2]))
                for variable, spec in zip(variables, specs, strict=True)
            ]
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(
            directory, f"{SHARDS_TABLE} is malformed ({type(e).__name__}: {e})"
        ) from None
    finally:
        reader.close()


def _reader_of(
    reader: ShardedReader, i: int
) -> Callable[[cross_process.Bounds], np.ndarray]:
    return lambda bounds: reader.read(i, bounds)


def _check_name(directory: str, name: Any) -> None:
    if (
        not isinstance(name, str)
        or os.path.basename(name) != name
        or not name.endswith(".bin")
    ):
        raise CorruptCheckpointError(directory, f"{SHARDS_TABLE} names {name!r}")


def _open(directory: str, name: str) -> int:
    _check_name(directory, name)
    path = os.path.join(directory, name)
    try:
        return file_io.open_regular(path, depth=file_io.CHECKPOINT_FILE)
    except FileNotFoundError:
        raise CorruptCheckpointError(directory, f"{name} is missing") from None
    except ValueError as e:
        raise CorruptCheckpointError(directory, str(e)) from None


def _key(piece: Any) -> tuple[str, int, int] | None:
    """Where a piece lies: (file, offset, bytes); `None` if malformed (its
    read then says what is wrong)."""
    if not isinstance(piece, dict):
        return None
    key = (piece.get("file"), piece.get("offset"), piece.get("nbytes"))
    kinds = (str, int, int)
    if not all(isinstance(k, t) for k, t in zip(key, kinds, strict=True)):
        return None
    # A negative range is refused when read: not worth a GET first.
    return key if key[1] >= 0 and key[2] >= 0 else None


def _overlapping(
    pieces: list[dict], start: tuple, stop: tuple
) -> Iterator[tuple[dict, list[int], list[int]]]:
    """Each of `pieces` that overlaps the slice `start`:`stop`, with the
    bounds of the overlap."""
    for piece in pieces:
        low = [max(a, b) for a, b in zip(start, piece["start"], strict=True)]
        high = [min(a, b) for a, b in zip(stop, piece["stop"], strict=True)]
        if all(lo < hi for lo, hi in zip(low, high, strict=True)):
            yield piece, low, high


def _overlaps(piece: dict, bounds: cross_process.Bounds) -> bool:
    try:
        return any(_overlapping([piece], *bounds))
    except (KeyError, TypeError, ValueError):
        return False  # Malformed: refused when read.


def _volume(start: list[int], stop: list[int]) -> int:
    return math.prod(max(0, b - a) for a, b in zip(start, stop, strict=True))
