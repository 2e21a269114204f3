"""How a checkpoint reaches disk, and how a reader knows it can trust one.

A checkpoint is a directory of files committed atomically: the files are
written into a staging directory, each one fsync'ed, a manifest with the size
and checksum of every file is written last, and the staging directory is
renamed to its final name. The rename is the commit: a reader only ever looks at
directories with a final name, and still verifies every checksum before it uses
one, so a torn write, a flipped bit or a deleted file is caught and the next
older checkpoint is used instead.

Checksums are XXH3-128: a torn write or a flipped bit changes it, and it runs
at memory speed (a SHA-256 of a checkpoint took longer than writing it). Big
files are handed over as buffers and checksummed on their way to disk, never
read back.

A checkpoint that retention lets go is not always deleted: the first becomes
the store's spare, and the next save overwrites its big files in place rather
than allocating new ones (on the disks measured, a write into a file's
existing blocks, with nothing freed, took half as long as a new file plus the
deletion of an old one). Only a directory no reader can name is ever
overwritten: the spare was renamed away from its committed name first. A
reader that opened a file before that holds a shared `flock` on it while it
reads (this module's verification, and the weights loader for as long as its
mapping lives), and a file so held is not recycled.

This module knows nothing of Keras: it stores whatever files a writer puts into
the staging directory, plus a JSON metadata dictionary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np
import xxhash

try:
    import fcntl
except ImportError:  # Not POSIX: lock.check_platform() stops a backup first.
    fcntl = None

MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.json"
FORMAT_NAME = "keras-ft-checkpoint"
FORMAT_VERSION = 1

_T = TypeVar("_T")

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})$")
_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
_SPARE_PREFIX = ".spare-"
# Files smaller than this are written anew rather than over a spare's.
_RECYCLE_MIN = 256 * 1024
_CHUNK = 4 * 1024 * 1024
# Buffers per writev(): Linux takes at most IOV_MAX (1024) at a time.
_IOV_BATCH = 512
# Direct I/O (no page cache) for a big page-aligned buffer. A buffer is
# written in pieces of _PIECE bytes, each as soon as it is filled, and
# checksummed as it goes.
_DIRECT_MIN = 8 * 1024 * 1024
_PIECE = 8 * 1024 * 1024
_PAGE = 4096
# The checksum a manifest records for each file.
_DIGEST = "xxh3_128"
_DIGESTS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128}
_DIGEST_NAMES = {"xxh3_128": "XXH3-128"}
# A manifest or metadata file larger than this is not one we wrote.
_MAX_JSON_BYTES = 64 * 1024 * 1024


class CheckpointError(Exception):
    """Base class of the errors raised by keras-ft about stored checkpoints."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint failed verification (damaged, truncated, missing)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"Checkpoint {path} is damaged: {reason}")
        self.path = path
        self.reason = reason


class NoGoodCheckpointError(CheckpointError):
    """Checkpoints exist, but every one of them failed verification."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written; the previous ones are intact."""


class SaveCancelled(CheckpointError):
    """A save was called off before its commit; nothing was committed."""


class Watermark(Protocol):
    """How far a buffer is ready (see `keras_ft.threads.Watermark`)."""

    def wait_for(self, level: int) -> None: ...

    def advance(self, level: int) -> None: ...

    def finish(self) -> None: ...


class ReadProgress:
    """How far a checkpoint's verification has read each of its files.

    A reader that follows it (`wait_for()`) finds the bytes it wants in the
    page cache instead of reading the disk in competition with the checksum.
    """

    def __init__(self) -> None:
        self._levels: dict[str, int] = {}
        self._done = False
        self._condition = threading.Condition()

    def advance(self, name: str, level: int) -> None:
        with self._condition:
            self._levels[name] = level
            self._condition.notify_all()

    def finish(self) -> None:
        """Verification is over (whatever its outcome): nobody need wait."""
        with self._condition:
            self._done = True
            self._condition.notify_all()

    def wait_for(self, name: str, level: int) -> None:
        """Waits until `name`'s first `level` bytes were read, or the end."""
        with self._condition:
            while not self._done and self._levels.get(name, 0) < level:
                self._condition.wait()


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory.

    Attributes:
        sequence: The checkpoint's number; a newer checkpoint has a larger one.
        path: The checkpoint's directory.
    """

    sequence: int
    path: str

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def file(self, name: str) -> str:
        """Returns the path of the file `name` inside this checkpoint."""
        return os.path.join(self.path, name)


class RetentionPolicy(Protocol):
    """Decides which committed checkpoints to delete after a new commit."""

    def select_for_deletion(
        self, checkpoints: Sequence[Checkpoint]
    ) -> list[Checkpoint]:
        """Returns the checkpoints to delete; `checkpoints` is oldest first."""
        ...


def checkpoint_name(sequence: int) -> str:
    """The directory name of the checkpoint numbered `sequence`."""
    return f"ckpt-{sequence:08d}"


class Staging(os.PathLike):
    """The directory a checkpoint is written into before its commit.

    It is a path (`os.path.join(staging, name)` works), so any library can
    write a file into it; the store checksums such files before the commit.
    `write_file()` is the fast way for big files: the buffers go to disk in
    one pass, with the checksum taken on the way.

    Args:
        path: The directory, which must exist.
        cancel: An event that, once set, makes `write_file()` stop with
            `SaveCancelled`. Defaults to `None`.
        recycle: A directory of files that `write_file()` may overwrite in
            place of new ones, taking them by name. Defaults to `None`.
        sync: Whether `write_file()` fsyncs each file. Defaults to `True`;
            a store's save syncs all of a checkpoint's files together.
    """

    def __init__(
        self,
        path: str,
        cancel: threading.Event | None = None,
        recycle: str | None = None,
        sync: bool = True,
    ):
        self.path = os.fspath(path)
        self.cancel = cancel
        self.recycle = recycle
        self.sync = sync
        self.digests: dict[str, dict[str, Any]] = {}

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"Staging({self.path!r})"

    def write_file(
        self,
        name: str,
        chunks: Sequence[Any],
        filled: Watermark | None = None,
        written: Watermark | None = None,
    ) -> None:
        """Writes the buffers `chunks`, one after another, as the file `name`.

        Args:
            name: The file's name.
            chunks: Buffers (see `write_file()`).
            filled: See `write_file()`. Defaults to `None`.
            written: See `write_file()`. Defaults to `None`.
        """
        path = os.path.join(self.path, name)
        size = sum(memoryview(c).nbytes for c in chunks)
        fd = self._recycled(name, path) if size >= _RECYCLE_MIN else None
        self.digests[name] = write_file(
            path,
            chunks,
            sync=self.sync,
            cancel=self.cancel,
            filled=filled,
            written=written,
            fd=fd,
        )

    def _recycled(self, name: str, path: str) -> int | None:
        """An open, exclusively locked file of the spare, moved to `path`."""
        if self.recycle is None:
            return None
        old = os.path.join(self.recycle, name)
        try:
            fd = os.open(old, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            # A reader that opened it before it stopped being a checkpoint
            # still holds a shared lock: then leave it to the reader.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            os.rename(old, path)
        except OSError:
            os.close(fd)
            return None
        return fd

    def check_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelled(f"The save into {self.path} was called off.")


def write_file(
    path: str,
    chunks: Sequence[Any],
    sync: bool = True,
    cancel: threading.Event | None = None,
    filled: Watermark | None = None,
    written: Watermark | None = None,
    fd: int | None = None,
) -> dict[str, Any]:
    """Writes buffers one after another into a new file at `path`.

    The data goes from the buffers to the kernel in calls that release the
    GIL, and is checksummed on the way rather than read back. A single big
    page-aligned buffer (a snapshot's copy) is written in pieces with direct
    I/O where the filesystem allows it: the disk reads it in place, so no CPU
    time is spent copying it into the page cache, and no cached pages are
    left behind.

    Args:
        path: The file to create (or truncate).
        chunks: Objects supporting the buffer protocol (bytes, memoryviews,
            C-contiguous NumPy arrays).
        sync: Whether to fsync the file before returning. Defaults to `True`.
        cancel: If set while writing, stop with `SaveCancelled`. Defaults to
            `None`.
        filled: With a single buffer that another thread is still filling,
            how far it is ready: each piece is written once it is. Defaults
            to `None` (all of it is ready).
        written: Advanced as the bytes of a single buffer leave it (for the
            thread that fills it next), and finished when this call returns
            or raises. Defaults to `None`.
        fd: An open descriptor of an existing file at `path` to overwrite in
            place (its blocks are reused; it is cut to the new size), which
            this call closes. Defaults to `None`: a new file.

    Returns:
        The file's manifest entry: its size and checksum.
    """
    try:
        views = [memoryview(c).cast("B") for c in chunks]
        views = [v for v in views if v.nbytes]
        if len(views) > 1 and (filled is not None or written is not None):
            raise ValueError("`filled` and `written` apply to one buffer only.")
        digest = _DIGESTS[_DIGEST]()
        size = sum(v.nbytes for v in views)
        overwrite = fd is not None
        if fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
        try:
            if len(views) == 1:
                _write_buffer(path, fd, views[0], digest, cancel, filled, written)
            else:
                offset = 0
                for start in range(0, len(views), _IOV_BATCH):
                    _check(cancel, path)
                    batch = views[start : start + _IOV_BATCH]
                    for view in batch:
                        digest.update(view)
                    _pwritev_all(fd, batch, offset)
                    offset += sum(v.nbytes for v in batch)
            if written is not None:
                written.finish()
            if overwrite:
                os.ftruncate(fd, size)
            if sync:
                # Over a recycled file the size and blocks may not change:
                # then only the data needs to reach the disk.
                (os.fdatasync if overwrite else os.fsync)(fd)
        finally:
            os.close(fd)
    finally:
        if written is not None:
            written.finish()
    return {"size": size, _DIGEST: digest.hexdigest()}


def _write_buffer(
    path: str,
    fd: int,
    view: memoryview,
    digest: Any,
    cancel: threading.Event | None,
    filled: Watermark | None,
    written: Watermark | None,
) -> None:
    """Writes one buffer into the empty file `fd`, piece by piece as it fills.

    Page-aligned, block-sized pieces of a big buffer go through a second,
    O_DIRECT descriptor when the filesystem takes it (not tmpfs); the rest
    through `fd` and the page cache.
    """
    direct_fd = _open_direct(path, view)
    aligned = view.nbytes - view.nbytes % _PAGE if direct_fd is not None else 0
    try:
        offset = 0
        while offset < view.nbytes:
            end = min(offset + _PIECE, view.nbytes)
            if offset < aligned:
                end = min(end, aligned)  # The unaligned tail goes on its own.
            _check(cancel, path)
            if filled is not None:
                filled.wait_for(end)
            piece = view[offset:end]
            # The checksum of a piece is taken while it is written, not
            # after: on the disk's path, it would slow every save.
            hashing = _submit(_hasher, digest.update, piece)
            try:
                if direct_fd is not None and end <= aligned:
                    try:
                        _pwrite_all(direct_fd, piece, offset)
                    except OSError as e:
                        if offset or e.errno != errno.EINVAL:
                            raise
                        # The filesystem refused the alignment: no direct I/O.
                        os.close(direct_fd)
                        direct_fd, aligned = None, 0
                        _pwrite_all(fd, piece, offset)
                else:
                    _pwrite_all(fd, piece, offset)
            finally:
                hashing.result()  # Before the buffer is let go, on error too.
            offset = end
            if written is not None:
                written.advance(end)
    finally:
        if direct_fd is not None:
            os.close(direct_fd)


def _open_direct(path: str, view: memoryview) -> int | None:
    """An O_DIRECT descriptor of `path` if direct I/O suits `view`."""
    direct = getattr(os, "O_DIRECT", 0)
    if (
        not direct
        or view.nbytes < _DIRECT_MIN
        or np.frombuffer(view, np.uint8).ctypes.data % _PAGE
    ):
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC | direct)
    except OSError:
        return None


def _check(cancel: threading.Event | None, path: str) -> None:
    if cancel is not None and cancel.is_set():
        raise SaveCancelled(f"The write of {path} was called off.")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        # A regular file takes everything unless the disk fills up, which
        # raises; a short write (a signal) continues where it stopped.
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views = views[1:]
        if views and written:
            views[0] = views[0][written:]


class CheckpointStore:
    """Commits, lists, verifies and prunes checkpoints in one directory.

    Args:
        directory: Where committed checkpoints live. Created on first save.
        retention: What to keep after each commit, a `RetentionPolicy`, or
            `None` to keep everything. Defaults to `None`.
    """

    def __init__(self, directory: str, retention: RetentionPolicy | None = None):
        self.directory = os.fspath(directory)
        self.retention = retention

    def __repr__(self) -> str:
        return f"CheckpointStore({self.directory!r})"

    # Reading.

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first. Unverified."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _CHECKPOINT_NAME.match(name)
            path = os.path.join(self.directory, name)
            if match and os.path.isdir(path):
                found.append(Checkpoint(int(match.group(1)), path))
        return sorted(found, key=lambda c: c.sequence)

    def verify(
        self, checkpoint: Checkpoint, progress: ReadProgress | None = None
    ) -> dict[str, Any]:
        """Checks every file of `checkpoint` against its manifest.

        Args:
            checkpoint: The checkpoint to check.
            progress: Told how far each file has been read, if given.

        Returns:
            The checkpoint's metadata dictionary.

        Raises:
            CorruptCheckpointError: naming what is wrong.
        """
        manifest = _read_json(checkpoint, MANIFEST_FILE)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(checkpoint.path, "manifest has no format tag")
        if manifest.get("version") != FORMAT_VERSION:
            raise CorruptCheckpointError(
                checkpoint.path,
                f"manifest version {manifest.get('version')!r} is not "
                f"{FORMAT_VERSION}; written by another keras-ft release?",
            )
        body = {k: v for k, v in manifest.items() if k != "digest"}
        if manifest.get("digest") != _json_digest(body):
            raise CorruptCheckpointError(checkpoint.path, "manifest digest mismatch")
        files = manifest.get("files")
        if not isinstance(files, dict) or METADATA_FILE not in files:
            raise CorruptCheckpointError(checkpoint.path, "manifest lists no files")
        for name, expected in files.items():
            _verify_file(checkpoint, name, expected, progress)
        metadata = _read_json(checkpoint, METADATA_FILE)
        if not isinstance(metadata, dict):
            raise CorruptCheckpointError(checkpoint.path, "metadata is not an object")
        return metadata

    def latest_good(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """The newest checkpoint that verifies, with its metadata.

        Damaged checkpoints are skipped with a warning and left in place.

        Returns:
            `(checkpoint, metadata)`, or `None` if there is no checkpoint.

        Raises:
            NoGoodCheckpointError: if checkpoints exist but none verifies.
        """
        found = self.latest_good_read(lambda checkpoint, progress: None)
        return None if found is None else found[:2]

    def latest_good_read(
        self, read: Callable[[Checkpoint, ReadProgress], _T]
    ) -> tuple[Checkpoint, dict[str, Any], _T] | None:
        """`latest_good()`, reading each candidate while it is verified.

        `read(checkpoint, progress)` runs in the calling thread while another
        thread checks the checkpoint's files, so that reading and
        checksumming overlap; following `progress`, it reads only what the
        checksum has already brought into memory. It must not act on what it
        reads, which may be damaged: its result is returned only for a
        checkpoint that verified, and an error it raised is raised only then.

        Returns:
            `(checkpoint, metadata, read(checkpoint))`, or `None` if there is
            no checkpoint.

        Raises:
            NoGoodCheckpointError: if checkpoints exist but none verifies.
        """
        candidates = self.checkpoints()
        problems = []
        for checkpoint in reversed(candidates):
            progress = ReadProgress()
            verifying = _submit(_verifier, self._verify_telling, checkpoint, progress)
            try:
                result, error = read(checkpoint, progress), None
            except Exception as e:  # Raised below if the checkpoint is good.
                result, error = None, e
            try:
                metadata = verifying.result()
            except CorruptCheckpointError as e:
                problems.append(str(e))
                warnings.warn(
                    f"{e}. Falling back to the previous checkpoint.", stacklevel=2
                )
                continue
            if error is not None:
                raise error
            return checkpoint, metadata, result
        if candidates:
            raise NoGoodCheckpointError(
                f"None of the {len(candidates)} checkpoints in {self.directory} "
                "can be restored; nothing was deleted. Problems found:\n  "
                + "\n  ".join(problems)
                + "\nMove the directory away to start training from scratch."
            )
        return None

    def _verify_telling(
        self, checkpoint: Checkpoint, progress: ReadProgress
    ) -> dict[str, Any]:
        try:
            return self.verify(checkpoint, progress)
        finally:
            progress.finish()

    # Writing.

    def save(
        self,
        write_files: Callable[[Staging], None],
        metadata: dict[str, Any],
        cancel: threading.Event | None = None,
        after: Callable[[], None] | None = None,
        supersedes: Callable[[], Checkpoint | None] | None = None,
    ) -> Checkpoint:
        """Writes and atomically commits a new checkpoint.

        Args:
            write_files: Called with the `Staging` directory; writes the
                checkpoint's files into it (plain files, no subdirectories),
                big ones best with `Staging.write_file()`.
            metadata: JSON-serialisable dictionary stored with the files.
            cancel: An event that, set before the commit, calls the save
                off: the partial checkpoint is removed and `SaveCancelled`
                raised. Defaults to `None`.
            after: Called once the files are written and synced, before the
                checkpoint gets its number and is committed; waits for a save
                that must commit first. Defaults to `None`.
            supersedes: Called once this checkpoint is committed; returns
                the checkpoint it replaces (or `None`), which is deleted
                before retention runs, so that it takes no older
                checkpoint's place. Defaults to `None`.

        Returns:
            The committed checkpoint.
        """
        os.makedirs(self.directory, exist_ok=True)
        staging = os.path.join(
            self.directory,
            f"{_STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}",
        )
        os.mkdir(staging)
        spare = self._take_spare(staging)
        try:
            written = Staging(staging, cancel, recycle=spare, sync=False)
            write_files(written)
            written.write_file(METADATA_FILE, [_json_bytes(metadata)])
            files = {}
            for name in sorted(os.listdir(staging)):
                path = os.path.join(staging, name)
                if not os.path.isfile(path) or os.path.islink(path):
                    raise ValueError(
                        f"A checkpoint holds plain files only; {name!r} is not one."
                    )
                files[name] = written.digests.get(name) or _entry(path)
            body = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "created_at": time.time(),
                "files": files,
            }
            _write_json(
                os.path.join(staging, MANIFEST_FILE),
                {**body, "digest": _json_digest(body)},
            )
            # Every file and the directory reach the disk before the commit;
            # synced together, the filesystem can flush them in one go.
            _fsync_together(
                [os.path.join(staging, n) for n in (*files, MANIFEST_FILE)] + [staging]
            )
            if after is not None:
                after()
            written.check_cancelled()
            sequence = self._next_sequence()
            final = os.path.join(self.directory, checkpoint_name(sequence))
            # The commit: rename() of a directory is atomic, and refuses to
            # replace a non-empty directory, so no committed checkpoint is
            # ever overwritten.
            os.rename(staging, final)
            _fsync_path(self.directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            if spare is not None:  # What of it was not reused.
                _remove_in_background(spare)
        committed = Checkpoint(sequence, final)
        replaced = supersedes() if supersedes is not None else None
        if replaced is not None and os.path.isdir(replaced.path):
            self.delete(replaced)
        self.prune()
        return committed

    def _take_spare(self, staging: str) -> str | None:
        """Claims the spare for the save into `staging`, if there is one."""
        for name in self._names(_SPARE_PREFIX):
            taken = f"{staging}.recycle"
            try:
                # Atomic: of two saves in flight, one gets it.
                os.rename(os.path.join(self.directory, name), taken)
            except OSError:
                continue
            return taken
        return None

    def _names(self, prefix: str | tuple[str, ...]) -> list[str]:
        try:
            return [n for n in os.listdir(self.directory) if n.startswith(prefix)]
        except FileNotFoundError:
            return []

    def prune(self) -> None:
        """Deletes the checkpoints that the retention policy lets go."""
        if self.retention is None:
            return
        committed = self.checkpoints()
        newest = committed[-1] if committed else None
        spare = bool(self._names(_SPARE_PREFIX))
        for checkpoint in self.retention.select_for_deletion(committed):
            if checkpoint == newest:
                continue
            if spare or not _has_big_file(checkpoint.path):
                self._delete(checkpoint.path)
            else:
                # Renamed away from its committed name, so that no reader
                # can find it any more, and kept for the next save to reuse.
                name = f"{_SPARE_PREFIX}{secrets.token_hex(6)}"
                os.rename(checkpoint.path, os.path.join(self.directory, name))
                spare = True

    def remove_leftovers(self) -> None:
        """Removes the staging, trash and spare directories a writer left."""
        for name in self._names((_STAGING_PREFIX, _TRASH_PREFIX, _SPARE_PREFIX)):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def clear(self) -> None:
        """Deletes every checkpoint and leftover this store made.

        Other files in the directory are left alone; the directory itself is
        removed only if that leaves it empty.
        """
        for checkpoint in self.checkpoints():
            self._delete(checkpoint.path)
        wait_for_removals()
        self.remove_leftovers()
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)

    def delete(self, checkpoint: Checkpoint) -> None:
        """Deletes one committed checkpoint."""
        self._delete(checkpoint.path)

    def _delete(self, path: str) -> None:
        # Rename first, so a kill during the removal never leaves a
        # half-deleted directory under a committed name. Removing big files
        # takes a while (more with online discard): not on the saver's time.
        trash = os.path.join(self.directory, f"{_TRASH_PREFIX}{secrets.token_hex(6)}")
        os.rename(path, trash)
        _remove_in_background(trash)

    def _next_sequence(self) -> int:
        committed = self.checkpoints()
        return committed[-1].sequence + 1 if committed else 1


# One thread removes deleted checkpoints; a kill leaves them as `.trash-*`
# directories, which `remove_leftovers()` clears at the next start.
_removals: set[Future] = set()
_removals_lock = threading.Lock()


@functools.cache
def _verifier() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="keras-ft-verify")


@functools.cache
def _remover() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="keras-ft-remover")


def _remove_in_background(path: str) -> None:
    with _removals_lock:
        future = _submit(_remover, shutil.rmtree, path, ignore_errors=True)
        _removals.add(future)
    future.add_done_callback(_forget_removal)


def _forget_removal(future: Future) -> None:
    with _removals_lock:
        _removals.discard(future)


def _has_big_file(directory: str) -> bool:
    """Whether a file in `directory` is big enough to be worth reusing."""
    try:
        with os.scandir(directory) as entries:
            return any(
                e.is_file(follow_symlinks=False) and e.stat().st_size >= _RECYCLE_MIN
                for e in entries
            )
    except OSError:
        return False


def wait_for_removals() -> None:
    """Waits until the checkpoints deleted so far are gone from disk."""
    with _removals_lock:
        pending = list(_removals)
    for future in pending:
        future.result()


def _json_digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _json_bytes(obj: Any, indent: int | None = None) -> bytes:
    # Without indentation json uses its C encoder: metadata with a model's
    # variable list and random states encodes ~10x faster.
    return json.dumps(obj, sort_keys=True, indent=indent).encode("utf-8")


def _write_json(path: str, obj: Any) -> None:
    """Writes a small JSON file meant to be read by people too (a manifest)."""
    with open(path, "wb") as f:
        f.write(_json_bytes(obj, indent=1))


def _read_json(checkpoint: Checkpoint, name: str) -> Any:
    path = checkpoint.file(name)
    try:
        if os.path.getsize(path) > _MAX_JSON_BYTES:
            raise CorruptCheckpointError(checkpoint.path, f"{name} is too large")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CorruptCheckpointError(checkpoint.path, f"{name} is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            checkpoint.path, f"{name} is not valid JSON ({e})"
        ) from None


def _verify_file(
    checkpoint: Checkpoint,
    name: Any,
    expected: Any,
    progress: ReadProgress | None = None,
) -> None:
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise CorruptCheckpointError(
            checkpoint.path, f"manifest names a file outside the checkpoint: {name!r}"
        )
    algorithm = (
        next((a for a in _DIGESTS if a in expected), None)
        if isinstance(expected, dict)
        else None
    )
    if (
        algorithm is None
        or not isinstance(expected.get("size"), int)
        or not isinstance(expected.get(algorithm), str)
    ):
        raise CorruptCheckpointError(
            checkpoint.path, f"manifest entry for {name} is malformed"
        )
    path = checkpoint.file(name)
    if not os.path.isfile(path) or os.path.islink(path):
        raise CorruptCheckpointError(checkpoint.path, f"{name} is missing")
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise CorruptCheckpointError(
            checkpoint.path,
            f"{name} has {size} bytes, the manifest says {expected['size']} "
            "(truncated or overwritten)",
        )
    read = None if progress is None else functools.partial(progress.advance, name)
    if _file_digest(path, algorithm, read) != expected[algorithm]:
        raise CorruptCheckpointError(
            checkpoint.path,
            f"{name} does not match its {_DIGEST_NAMES[algorithm]} checksum",
        )


def _entry(path: str) -> dict[str, Any]:
    """The manifest entry of a file written by someone else."""
    return {"size": os.path.getsize(path), _DIGEST: _file_digest(path, _DIGEST)}


def _fsync_together(paths: list[str]) -> None:
    """fsyncs the files (or directories) concurrently; raises the first error."""
    for done in [_submit(_syncer, _fsync_path, p) for p in paths]:
        done.result()


def _submit(
    executor: Callable[[], ThreadPoolExecutor], fn: Callable, *args, **kwargs
) -> Future:
    """`executor().submit(fn, ...)`, or `fn` run here once the interpreter exits.

    At exit, executors take no new work; a write still committing (which the
    interpreter waits for) then does the rest of it in its own thread.
    """
    try:
        return executor().submit(fn, *args, **kwargs)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:
            done.set_exception(e)
        return done


@functools.cache
def _hasher() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(2, thread_name_prefix="keras-ft-checksum")


@functools.cache
def _syncer() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(4, thread_name_prefix="keras-ft-fsync")


def _file_digest(
    path: str, algorithm: str, read: Callable[[int], None] | None = None
) -> str:
    """The file's checksum; `read(n)` is told when its first n bytes were read."""
    digest = _DIGESTS[algorithm]()
    with open(path, "rb") as f:
        # So that the file is not recycled while it is read (see the module).
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        size = os.fstat(f.fileno()).st_size
        if size < _CHUNK:
            digest.update(f.read())
            return digest.hexdigest()
        # Mapped rather than read: the kernel reads ahead while the checksum
        # runs, and the pages stay cached for the loader that comes next.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(mapped) as view:
                for start in range(0, size, _CHUNK):
                    digest.update(view[start : start + _CHUNK])
                    if read is not None:
                        read(min(start + _CHUNK, size))
    return digest.hexdigest()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
