"""A checkpoint file's bytes on their way to disk, and back.

Big files are handed over as buffers and written in one pass, with direct I/O
where the filesystem allows it, checksummed (XXH3-128: a torn write or a
flipped bit changes it, and it runs at memory speed) on their way to disk,
never read back. A file may be written over a spare one in place (its blocks
reused), taken only if no reader holds a shared `flock` on it.

Nothing here decides what a checkpoint is: `store.py` commits the files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from keras_ft import events, threads
from keras_ft.errors import SaveCancelled
from keras_ft.threads import Watermark

try:
    import fcntl
except ImportError:  # Not POSIX: lock.check_platform() stops a backup first.
    fcntl = None

# Files smaller than this are written anew rather than over a spare's.
RECYCLE_MIN = 256 * 1024
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
DIGEST = "xxh3_128"
DIGESTS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128}
DIGEST_NAMES = {"xxh3_128": "XXH3-128"}
# A manifest or metadata file larger than this is not one we wrote.


class ReadProgress:
    """How far a checkpoint's verification has read each of its files.

    A reader that follows it (`wait_for()`) finds the bytes it wants in the
    page cache instead of reading the disk in competition with the checksum.
    """

    def __init__(self, shown: events.Progress | None = None) -> None:
        self._levels: dict[str, int] = {}
        self._done = False
        self._condition = threading.Condition()
        self._shown = shown  # A restore's progress line, moved along.

    def advance(self, name: str, level: int) -> None:
        with self._condition:
            read = level - self._levels.get(name, 0)
            self._levels[name] = level
            self._condition.notify_all()
        if self._shown is not None and read > 0:
            self._shown.add(read)

    def finish(self) -> None:
        """Verification is over (whatever its outcome): nobody need wait."""
        with self._condition:
            self._done = True
            self._condition.notify_all()
        if self._shown is not None:
            self._shown.close()

    def wait_for(self, name: str, level: int) -> None:
        """Waits until `name`'s first `level` bytes were read, or the end."""
        with self._condition:
            while not self._done and self._levels.get(name, 0) < level:
                self._condition.wait()


class WrittenFiles:
    """The identities (device, inode) of the last big files this process
    wrote into one directory.

    A spare's file is overwritten in place only if it is one of these: a
    file that someone else put in a backup directory (moved in, or the one
    name left of a file another process holds open) is never written
    through. Bounded: a checkpoint retired long ago is no spare any more.
    """

    _KEPT = 64

    def __init__(self) -> None:
        self._identities: dict[tuple[int, int], None] = {}
        self._lock = threading.Lock()

    def add(self, status: os.stat_result) -> None:
        with self._lock:
            key = (status.st_dev, status.st_ino)
            self._identities.pop(key, None)
            self._identities[key] = None
            while len(self._identities) > self._KEPT:
                del self._identities[next(iter(self._identities))]

    def wrote(self, status: os.stat_result) -> bool:
        with self._lock:
            return (status.st_dev, status.st_ino) in self._identities


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
        written: The identities (device, inode) of the files this process
            wrote into the directory, across saves: only such a file of the
            spare is overwritten in place (one put there by anyone else,
            however it looks, may be seen from outside the backup), and
            `write_file()` adds each file it writes. Defaults to `None`.
        pin: Whether to write through the directory as opened now, so that
            if its name is swapped for a symlink (in a backup directory that
            others can write), nothing is written where the link points: its
            path (`os.fspath()`) is then `/proc/self/fd/<n>` on Linux, while
            `path` stays its name (to rename it). `path` and `recycle` must
            each be `<chief>/<name>`, reached without a symlink. Defaults to
            `False`.
        pools: The helper threads that checksum and fsync the files (a
            training's). Defaults to `None`: the writing thread does it.
    """

    def __init__(
        self,
        path: str,
        cancel: threading.Event | None = None,
        recycle: str | None = None,
        sync: bool = True,
        pin: bool = False,
        written: WrittenFiles | None = None,
        pools: threads.Pools | None = None,
    ):
        self.path = os.fspath(path)
        self.cancel = cancel
        self.pools = pools
        self.recycle = recycle
        self.sync = sync
        self._written = written
        self._through = self.path
        self._recycle_fd: int | None = None
        self._reuse = recycle is not None
        if pin:
            self._through = _pinned_directory(self, self.path)
        if pin and recycle is not None:
            try:
                self._recycle_fd = open_directory(recycle)
            except (OSError, ValueError):  # Not a directory of ours: not reused.
                self._reuse = False
            else:
                weakref.finalize(self, os.close, self._recycle_fd)
        self.digests: dict[str, dict[str, Any]] = {}
        # Files put here already on disk (fsync'ed by whoever wrote them).
        self.synced: set[str] = set()
        # Files of the checkpoint that other processes put in its place in a
        # bucket already (a sharded save's pieces): their manifest entries.
        # Listed in the manifest, never staged or uploaded here.
        self.in_place: dict[str, dict[str, Any]] = {}
        # Files of the checkpoint to take from elsewhere on this machine, by
        # name (a local tier's checkpoint copied to a bucket): their entries
        # are in `digests`; a store that stages by copying reads them there.
        self.from_paths: dict[str, str] = {}
        # The number the commit takes, where other processes wrote into the
        # checkpoint before it (agreed beforehand); `None`: the next free one.
        self.sequence: int | None = None

    def __fspath__(self) -> str:
        return self._through

    def __repr__(self) -> str:
        return f"Staging({self.path!r})"

    def write_file(
        self,
        name: str,
        chunks: Sequence[Any],
        filled: Watermark | None = None,
        written: threading.Event | None = None,
    ) -> None:
        """Writes the buffers `chunks`, one after another, as the file `name`.

        Args:
            name: The file's name.
            chunks: Buffers (see `write_file()`).
            filled: See `write_file()`. Defaults to `None`.
            written: See `write_file()`. Defaults to `None`.
        """
        path = os.path.join(self._through, name)
        size = sum(memoryview(c).nbytes for c in chunks)
        fd = self._recycled(name, path) if size >= RECYCLE_MIN else None
        self.digests[name] = write_file(
            path,
            chunks,
            sync=self.sync,
            cancel=self.cancel,
            filled=filled,
            written=written,
            fd=fd,
            hasher=self.pools.hasher if self.pools is not None else None,
        )
        if self._written is not None and size >= RECYCLE_MIN:
            self._written.add(os.stat(path, follow_symlinks=False))

    def _recycled(self, name: str, path: str) -> int | None:
        """An open, exclusively locked file of the spare, moved to `path`."""
        if self.recycle is None or not self._reuse:
            return None
        old = os.path.join(self.recycle, name)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        pinned = self._recycle_fd is not None
        try:
            # Relative to the spare as opened, where pinned: never through a
            # link; for reading, until it is known to be a file of our own.
            seen = os.open(name if pinned else old, flags, dir_fd=self._recycle_fd)
        except OSError:
            return None
        fd = None
        try:
            if not self._own_file(os.fstat(seen)):
                raise OSError(errno.EINVAL, "not a regular file of its own")
            # The same file opened again for writing, not its name (Linux;
            # elsewhere no file is recycled).
            fd = os.open(f"/proc/self/fd/{seen}", os.O_WRONLY | os.O_CLOEXEC)
            # A reader that opened it before it stopped being a checkpoint
            # still holds a shared lock: then leave it to the reader.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            status = os.fstat(fd)
            if not self._own_file(status) or not os.path.samestat(
                status, os.fstat(seen)
            ):
                raise OSError(errno.EINVAL, "not a regular file of its own")
            if not pinned:
                os.rename(old, path)
            else:
                os.rename(name, path, src_dir_fd=self._recycle_fd)
        except OSError:
            if fd is not None:
                os.close(fd)
            return None
        finally:
            os.close(seen)
        return fd

    def _own_file(self, status: os.stat_result) -> bool:
        """Whether a spare's file is one this writer wrote, with no other
        name: a second hard link (a `cp -al` snapshot) would see a write
        into it, and so would anyone holding a file they put in the spare."""
        return (
            stat.S_ISREG(status.st_mode)
            and status.st_nlink == 1
            and self._written is not None
            and self._written.wrote(status)
        )

    def check_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelled(f"The save into {self.path} was called off.")


def write_file(
    path: str,
    chunks: Sequence[Any],
    sync: bool = True,
    cancel: threading.Event | None = None,
    filled: Watermark | None = None,
    written: threading.Event | None = None,
    fd: int | None = None,
    hasher: threads.Pool | None = None,
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
        written: Set once the bytes have left the buffers (for the thread
            that fills them next), before the fsync, and when this call
            raises. Defaults to `None`.
        fd: An open descriptor of an existing file at `path` to overwrite in
            place (its blocks are reused; it is cut to the new size), which
            this call closes. Defaults to `None`: a new file.
        hasher: The threads that checksum a single buffer's pieces while
            they are written. Defaults to `None`: this thread does.

    Returns:
        The file's manifest entry: its size and checksum.
    """
    try:
        views = [memoryview(c).cast("B") for c in chunks]
        views = [v for v in views if v.nbytes]
        if len(views) > 1 and filled is not None:
            raise ValueError("`filled` applies to one buffer only.")
        digest = DIGESTS[DIGEST]()
        size = sum(v.nbytes for v in views)
        overwrite = fd is not None
        if fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
        try:
            if len(views) == 1:
                _write_buffer(path, fd, views[0], digest, cancel, filled, hasher)
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
                written.set()
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
            written.set()
    return {"size": size, DIGEST: digest.hexdigest()}


def _write_buffer(
    path: str,
    fd: int,
    view: memoryview,
    digest: Any,
    cancel: threading.Event | None,
    filled: Watermark | None,
    hasher: threads.Pool | None,
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
            hashing = threads.submit(hasher, digest.update, piece)
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


def has_big_file(directory: str) -> bool:
    """Whether a file in `directory` is big enough to be worth reusing."""
    try:
        with os.scandir(directory) as entries:
            return any(
                e.is_file(follow_symlinks=False) and e.stat().st_size >= RECYCLE_MIN
                for e in entries
            )
    except OSError:
        return False


def entry(path: str) -> dict[str, Any]:
    """The manifest entry of a file written by someone else."""
    return {"size": os.path.getsize(path), DIGEST: file_digest(path, DIGEST)}


def fsync_together(paths: list[str], syncer: threads.Pool | None) -> None:
    """fsyncs the files (or directories), concurrently in `syncer`'s threads
    if given; raises the first error."""
    for done in [threads.submit(syncer, fsync_path, p) for p in paths]:
        done.result()


def file_digest(
    path: str,
    algorithm: str,
    read: Callable[[int], None] | None = None,
    depth: int = 1,
    arrived: Callable[[int], None] | None = None,
) -> str:
    """The file's checksum; `read(n)` is told when its first n bytes were
    read. `depth` is as in `open_regular()`. `arrived(n)`, for a file still
    being written (a download), returns once its first n bytes are there."""
    digest = DIGESTS[algorithm]()
    with os.fdopen(open_regular(path, depth=depth), "rb") as f:
        # So that the file is not recycled while it is read (see the module).
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        size = os.fstat(f.fileno()).st_size
        if size < _CHUNK:
            if arrived is not None:
                arrived(size)
            digest.update(f.read())
            if read is not None:
                read(size)
            return digest.hexdigest()
        # Read rather than mapped: from disk, read() in big chunks ran 3-4x
        # faster here than faulting the pages of a mapping in (a restore
        # reads from disk: saves bypass the page cache), and the pages stay
        # cached for the loader that maps the file next.
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        done = 0
        while done < size:
            if arrived is not None:
                arrived(min(done + _CHUNK, size))
            count = f.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
            done += count
            if read is not None:
                read(done)
    return digest.hexdigest()


# `open_regular()` depths: a checkpoint's file, `<chief>/<checkpoint>/<file>`,
# and a notice in the chief's directory, `<chief>/<file>`.
CHECKPOINT_FILE = 3
CHIEF_FILE = 2


def open_regular(path: str, flags: int = os.O_RDONLY, *, depth: int = 1) -> int:
    """`os.open()` of a regular file, following no symlink, never blocking
    (a FIFO). A backup is untrusted input: anything else is refused.

    Args:
        path: The file.
        flags: For `os.open()`. Defaults to `os.O_RDONLY`.
        depth: How many of the last components of `path` must not be
            symlinks: 1 for the file alone, 3 for a checkpoint's file
            (`<chief>/<checkpoint>/<file>`: the directories above `chief`
            are the user's). Checked on the open descriptor, so that a
            directory swapped for a link between a check and the open is
            caught (on Linux, through `/proc`; elsewhere only the file).

    Raises:
        FileNotFoundError: if there is no file at `path`, or it was moved
            while it was opened.
        ValueError: if `path` is a symlink, FIFO, device or directory, or is
            reached through a symlink.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(_link_message(path)) from None
        if e.errno not in (errno.ENXIO, errno.EISDIR):  # A FIFO, a directory.
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise ValueError(
            f"{path!r} is not a regular file (a FIFO, device or directory); "
            "keras-ft does not use it. Remove it."
        )
    try:
        if depth > 1:
            _check_reached_directly(fd, path, depth)
    except BaseException:
        os.close(fd)
        raise
    if not flags & (os.O_WRONLY | os.O_RDWR):
        os.set_blocking(fd, True)  # Regular files never block; reads expect it.
    return fd


def _check_reached_directly(fd: int, path: str, depth: int) -> None:
    """Raises unless the file open as `fd` is the one at `path` with none of
    its last `depth` components a symlink."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # No /proc: the final component's O_NOFOLLOW is all.
        return
    head, tail = os.path.abspath(path), []
    for _ in range(depth):
        head, part = os.path.split(head)
        tail.append(part)
    expected = os.path.join(os.path.realpath(head), *reversed(tail))
    if opened == expected:
        return
    prefixes = [os.path.join(head, *reversed(tail[i:])) for i in range(1, depth)]
    if any(os.path.islink(p) for p in prefixes):
        raise ValueError(_link_message(path))
    # Renamed or deleted while it was opened (a checkpoint retention let go).
    raise FileNotFoundError(errno.ENOENT, "moved while it was opened", path)


def open_directory(path: str, depth: int = CHIEF_FILE) -> int:
    """A descriptor of the directory at `path`, none of whose last `depth`
    components is a symlink (see `open_regular()`): 2 for `<chief>/<name>`,
    1 for the chief's directory itself."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        # A symlink at the last component: ELOOP, or ENOTDIR on some systems.
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise ValueError(_link_message(path)) from None
        raise
    try:
        _check_reached_directly(fd, path, depth)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pinned_directory(owner: object, path: str) -> str:
    """`/proc/self/fd/<n>` of the directory at `path`, open while `owner`
    lives; `path` itself where there is no `/proc`."""
    fd = open_directory(path)
    weakref.finalize(owner, os.close, fd)
    through = f"/proc/self/fd/{fd}"
    return through if os.path.isdir(through) else path


def _link_message(path: str) -> str:
    return (
        f"{path!r} is or is reached through a symlink; keras-ft follows no "
        "link in a backup directory. Remove it."
    )


@contextlib.contextmanager
def pinned(path: str, depth: int, name: str | None = None) -> Iterator[str]:
    """A path that reaches the regular file at `path` as opened now, for a
    library that opens files by name (h5py, Keras): whatever later happens
    to `path`'s directories, it reads this file (see `open_regular()`).

    Args:
        path: The file.
        depth: As in `open_regular()`.
        name: If given, the path ends with it (Keras checks the suffix).

    Yields:
        `/proc/self/fd/<n>` (or a link named `name` to it) on Linux;
        elsewhere `path` itself.
    """
    fd = open_regular(path, depth=depth)
    try:
        proc = f"/proc/self/fd/{fd}"
        if not os.path.exists(proc):
            yield path
        elif name is None:
            yield proc
        else:
            with tempfile.TemporaryDirectory(prefix="keras-ft-pin-") as directory:
                link = os.path.join(directory, name)
                os.symlink(proc, link)
                yield link
    finally:
        os.close(fd)


def read_regular(path: str, limit: int, depth: int = 1) -> bytes:
    """The whole regular file at `path`, at most `limit` bytes (see
    `open_regular()`, which `depth` is for); its size is checked on the
    open file.

    Raises:
        FileNotFoundError: if there is no file at `path`.
        ValueError: if it is not a regular file, or larger than `limit`.
    """
    fd = open_regular(path, depth=depth)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(
                f"{os.path.basename(path)} is too large ({size} bytes; at most "
                f"{limit} are read)"
            )
        return f.read(limit + 1)[:limit]


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
