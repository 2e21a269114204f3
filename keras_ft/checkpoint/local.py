"""The storage protocol on a POSIX filesystem: rename-commit, fsync, flock.

A checkpoint's files are written into `<directory>/.staging-*`, every file and
the directory are fsync'ed, and the directory is renamed to `ckpt-<n>`: the
rename is the commit. A reader only ever looks at directories with a final
name.

A checkpoint that retention lets go is not always deleted: the first becomes
the spare, and the next save overwrites its big files in place rather than
allocating new ones (on the disks measured, a write into a file's existing
blocks, with nothing freed, took half as long as a new file plus the deletion
of an old one). Only a directory no reader can name is ever overwritten: the
spare was renamed away from its committed name first. A reader that opened a
file before that holds a shared `flock` on it while it reads (verification,
and the weights loader for as long as its mapping lives), and a file so held
is not recycled, nor is one with a second hard link, nor any file this
process's saves into the directory did not write (`files.WrittenFiles`).

A backup directory is untrusted input: a checkpoint directory or file that is
a symlink, a FIFO or a device is never followed or opened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import IO

from keras_ft import holdings, threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import (
    Checkpoint,
    CommitTurn,
    checkpoint_name,
    checkpoint_sequence,
    is_url,
)
from keras_ft.checkpoint.lock import DirectoryLock
from keras_ft.checkpoint.parts import PARTS_PREFIX, LocalParts

_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
_SPARE_PREFIX = ".spare-"
# Where the processes of a sharded save put their pieces before the chief's
# commit gathers them (`distribute/sharded.py`): what a killed save left.
_LEFTOVERS = (_STAGING_PREFIX, _TRASH_PREFIX, _SPARE_PREFIX, PARTS_PREFIX)
# A finished backup's checkpoints while they are removed in the background
# (`LocalHousekeeping.discard()`): `<_TRASH_ENTRY><token>` in this user's trash
# (`<tempdir>/keras-ft-trash-<uid>`), or where that is on another filesystem,
# `.<name of backup_dir><_DISCARDED>-<token>` beside `backup_dir`.
_DISCARDED = ".keras-ft-deleted"
_TRASH_ENTRY = "deleted-"


class LocalStorage:
    """Checkpoints in one directory of a POSIX filesystem.

    What a restore reads is `reader` (a `LocalReader`), the small files
    beside the checkpoints are `notices` (`LocalNotices`), and what is
    around them (leftovers, scratch, the directory itself) is
    `housekeeping` (`LocalHousekeeping`).

    Args:
        directory: Where committed checkpoints live. Created on first save.
    """

    write_error_fix = "Free some space or fix the directory's permissions"
    start_over_fix = "Move the directory away to start training from scratch."

    def __init__(self, directory: str):
        self.directory = self.location = os.fspath(directory)
        # The files this process's saves into this directory wrote: only
        # those are recycled.
        self._written = _written_files(self.identity)
        self.reader = LocalReader()
        self.notices = LocalNotices(self.directory)
        self.housekeeping = LocalHousekeeping(self)

    @property
    def identity(self) -> str:
        """The same for every storage of this directory, whatever the path."""
        return os.path.realpath(self.directory)

    def url(self, checkpoint: Checkpoint) -> str:
        return checkpoint.path

    # Listing.

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first. Unverified."""
        found = []
        for name in _names(self.directory):
            sequence = checkpoint_sequence(name)
            path = os.path.join(self.directory, name)
            # A real directory: a symlink named like one is not followed.
            if sequence is not None and _is_directory(path):
                found.append(Checkpoint(sequence, path))
        return sorted(found, key=lambda c: c.sequence)

    def next_sequence(self) -> int:
        """The number the next checkpoint takes (a disk's sharded saves name
        their parts by the save instead: see `parts()`)."""
        return max((c.sequence for c in self.checkpoints()), default=0) + 1

    def parts(self, tag: str, sequence: int) -> LocalParts:
        """Where the processes' parts of the sharded save `tag` wait for its
        commit: a directory beside the checkpoints (`sequence` unused)."""
        return LocalParts(self.directory, tag)

    # Writing.

    def stage(
        self, cancel: threading.Event | None, pools: threads.Pools | None = None
    ) -> Staging:
        """A new staging directory, with the spare to write over, if any."""
        name = f"{_STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(self.directory, name)
        with _opened(self.directory, create=True) as directory:
            os.mkdir(name, dir_fd=directory)
        return Staging(
            path,
            cancel,
            recycle=self._take_spare(path),
            sync=False,
            pin=True,
            written=self._written,
            pools=pools,
        )

    def commit(
        self,
        staging: Staging,
        names: list[str],
        turn: CommitTurn,
    ) -> Checkpoint:
        """Syncs the staged files and renames the directory: the commit."""
        if staging.from_paths or staging.in_place:
            raise ValueError("A checkpoint on disk holds its files in its directory.")
        # Every file and the directory reach the disk before the commit;
        # synced together, the filesystem can flush them in one go.
        unsynced = [n for n in names if n not in staging.synced]
        through = os.fspath(staging)  # The directory as opened, not its name.
        syncer = staging.pools.syncer if staging.pools is not None else None
        paths = [os.path.join(through, n) for n in unsynced] + [through]
        file_io.fsync_together(paths, syncer)
        turn.take()
        staging.check_cancelled()
        committed = self.checkpoints()
        sequence = committed[-1].sequence + 1 if committed else 1
        final = os.path.join(self.directory, checkpoint_name(sequence))
        turn.numbered(Checkpoint(sequence, final))
        # rename() of a directory is atomic, and refuses to replace a
        # non-empty directory, so no committed checkpoint is ever overwritten.
        _rename(self.directory, staging.path, final)
        file_io.fsync_path(self.directory)
        return Checkpoint(sequence, final)

    def unstage(self, staging: Staging) -> None:
        """Removes what `stage()` made and the commit did not take."""
        if os.path.isdir(staging.path):
            shutil.rmtree(staging.path, ignore_errors=True)
        if staging.recycle is not None:  # What of the spare was not reused.
            threads.remove_in_background(staging.recycle)

    def _take_spare(self, staging: str) -> str | None:
        for name in self._spares():
            taken = f"{staging}.recycle"
            try:
                # Atomic: of two saves in flight, one gets it.
                _rename(self.directory, os.path.join(self.directory, name), taken)
            except OSError:
                continue
            return taken
        return None

    def _spares(self) -> list[str]:
        """The spares' names: a link named like one is nobody's spare."""
        return [
            n
            for n in _names(self.directory, _SPARE_PREFIX)
            if _is_directory(os.path.join(self.directory, n))
        ]

    def retire(self, checkpoint: Checkpoint) -> None:
        """Lets a checkpoint go: kept as the spare if it is worth reusing."""
        if self._spares() or not file_io.has_big_file(checkpoint.path):
            self.delete(checkpoint)
            return
        # Renamed away from its committed name, so that no reader can find
        # it any more, and kept for the next save to reuse.
        name = f"{_SPARE_PREFIX}{secrets.token_hex(6)}"
        _rename(self.directory, checkpoint.path, os.path.join(self.directory, name))

    def delete(self, checkpoint: Checkpoint) -> None:
        # Rename first, so a kill during the removal never leaves a
        # half-deleted directory under a committed name. Removing big files
        # takes a while (more with online discard): not on the saver's time.
        # A kill leaves `.trash-*`, removed as a leftover at the next start.
        trash = os.path.join(self.directory, f"{_TRASH_PREFIX}{secrets.token_hex(6)}")
        _rename(self.directory, checkpoint.path, trash)
        threads.remove_in_background(trash)

    # One writer.

    def writer_lock(self) -> DirectoryLock:
        """An exclusive `flock` on the directory's `.lock`."""
        return DirectoryLock(self.directory)

    def check_writable(self) -> None:
        """Creates the directory and a file in it, or raises naming it.

        The file is made through the directory as opened with no symlink
        followed: a directory that is a link is refused before anything is
        written where it points.
        """
        try:
            with _opened(self.directory, create=True) as directory:
                _probe_write(directory)
        except OSError as e:
            raise ValueError(
                f"Invalid value for argument `backup_dir`: cannot write to "
                f"{self.directory!r} ({e.strerror or e}). Choose a directory "
                "this process can create and write."
            ) from e


class LocalReader:
    """Reads a disk's checkpoints: regular files only, no link followed,
    sizes of the open file.

    Args:
        arrived: For a directory whose files are still being written (a
            download of a bucket's checkpoint): `arrived(name)` is `None`
            for a file that is whole, else a function that returns once the
            file's first n bytes are there; checksums follow it. Defaults
            to `None`: every file is whole.
    """

    ranged_reads = False  # A reader opens the files in place.

    def __init__(
        self, arrived: Callable[[str], Callable[[int], None] | None] | None = None
    ):
        self._arrived = arrived

    def names(self, checkpoint: Checkpoint) -> set[str]:
        return set(os.listdir(checkpoint.path))

    def size(self, checkpoint: Checkpoint, name: str) -> int:
        """The size of a regular file; `FileNotFoundError` for anything else."""
        try:
            status = os.lstat(os.path.join(checkpoint.path, name))
        except NotADirectoryError:
            raise FileNotFoundError(name) from None
        if not stat.S_ISREG(status.st_mode):
            raise FileNotFoundError(f"{name} is not a regular file")
        return status.st_size

    def digest(
        self,
        checkpoint: Checkpoint,
        name: str,
        algorithm: str,
        read: Callable[[int], None] | None = None,
    ) -> str:
        return file_io.file_digest(
            os.path.join(checkpoint.path, name),
            algorithm,
            read,
            depth=file_io.CHECKPOINT_FILE,
            arrived=None if self._arrived is None else self._arrived(name),
        )

    def open_file(self, checkpoint: Checkpoint, name: str) -> IO[bytes]:
        path = os.path.join(checkpoint.path, name)
        fd = file_io.open_regular(path, depth=file_io.CHECKPOINT_FILE)
        return os.fdopen(fd, "rb")

    def read_bytes(self, checkpoint: Checkpoint, name: str, limit: int) -> bytes:
        return file_io.read_regular(
            os.path.join(checkpoint.path, name), limit, file_io.CHECKPOINT_FILE
        )

    def local_copy(
        self,
        checkpoint: Checkpoint,
        sizes: dict[str, int],
        stream: frozenset[str] = frozenset(),
        ranged: frozenset[str] = frozenset(),
    ) -> Checkpoint:
        """The checkpoint to load from: on disk, itself."""
        return checkpoint

    def copy_reader(self, local: Checkpoint) -> LocalReader:
        """The reader of `local_copy()`'s files: this one."""
        return self

    def release(self, local: Checkpoint) -> None:
        """Nothing to free: `local_copy()` made no copy."""


class LocalNotices:
    """Small files beside a disk's checkpoints that every process of a
    training reads; written whole through the directory as opened."""

    def __init__(self, directory: str):
        self.directory = directory

    def create(self, name: str, data: bytes) -> bool:
        """Writes `name` unless it exists (a hard link: the first wins)."""
        with _opened(self.directory, create=True) as directory:
            temporary = _write_temporary(directory, name, data)
            try:
                # Atomic, and fails if one exists.
                os.link(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
            except FileExistsError:
                return False
            finally:
                os.remove(temporary, dir_fd=directory)
        return True

    def read(self, name: str, limit: int) -> bytes | None:
        try:
            return file_io.read_regular(
                os.path.join(self.directory, name), limit, file_io.CHIEF_FILE
            )
        except FileNotFoundError:
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError), _opened(self.directory) as fd:
            os.remove(name, dir_fd=fd)

    def replace(self, name: str, data: bytes) -> None:
        with _opened(self.directory, create=True) as directory:
            temporary = _write_temporary(directory, name, data)
            try:
                # A symlink there is replaced, not followed.
                os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(temporary, dir_fd=directory)
                raise

    def names(self) -> list[str]:
        """The regular files beside the checkpoints."""
        return [
            n
            for n in _names(self.directory)
            if stat.S_ISREG(os.lstat(os.path.join(self.directory, n)).st_mode)
        ]


class LocalHousekeeping:
    """What is around a disk's checkpoints: what partial or deleted saves
    left, a process's scratch directory, the directory itself."""

    def __init__(self, storage: LocalStorage):
        self._storage = storage
        self.directory = storage.directory

    def scratch_dir(self, name: str) -> str:
        """A local directory beside this one, for a process's throwaway saves."""
        return os.path.join(os.path.dirname(self.directory), name)

    def usage(self, path: str) -> int:
        """Bytes in the files below `path`; no link is followed."""
        if not _is_directory(path):
            return os.lstat(path).st_size
        return sum(
            os.lstat(os.path.join(root, name)).st_size
            for root, _, names in os.walk(path)
            for name in names
        )

    def leftovers(self) -> list[str]:
        """Staging, trash, spare and parts directories: partial or deleted saves."""
        return [p for p in self._leftover_paths() if _is_directory(p)]

    def foreign(self) -> list[str]:
        """Entries named like leftovers that are not directories (a symlink,
        a file): nobody's save. Removed with the leftovers, never followed."""
        return [p for p in self._leftover_paths() if not _is_directory(p)]

    def remove_leftovers(self) -> None:
        for path in self._leftover_paths():
            _remove_tree(path)

    def _leftover_paths(self) -> list[str]:
        names = sorted(_names(self.directory, _LEFTOVERS))
        return [os.path.join(self.directory, n) for n in names]

    def discard(self, beside: str) -> bool:
        """Moves every checkpoint and leftover out of this directory and
        removes them in the background: this directory holds nothing of a
        save's at once, whatever the checkpoints' size.

        They go to this user's trash in the temporary directory where that
        is on the same filesystem (`_trash()`): nothing appears beside
        `backup_dir`, so removing the directory that holds it right after
        `fit()` does not race the removal. Elsewhere they go beside
        `beside` (`backup_dir`, which this directory is or is in). A kill
        leaves them for the next start's `sweep_discarded()`.

        Returns `False` where neither place can take them (no permission,
        another filesystem); what was not moved is still here then."""
        paths = [c.path for c in self._storage.checkpoints()]
        entries = [os.path.basename(p) for p in paths + self._leftover_paths()]
        parent, name = os.path.split(os.path.abspath(beside))
        places = [(_trash(parent), _TRASH_ENTRY), (parent, f".{name}{_DISCARDED}-")]
        for place, prefix in places:
            if place is None or not entries:
                continue
            into = os.path.join(place, f"{prefix}{secrets.token_hex(6)}")
            try:
                os.mkdir(into, 0o700)
            except OSError:
                continue
            with contextlib.suppress(OSError):
                self._move_into(entries, into)
            threads.remove_in_background(into, discard=True)
        return not entries

    def _move_into(self, entries: list[str], into: str) -> None:
        """Renames `entries` of this directory into the directory `into`,
        dropping each from the list once moved; raises at the first that
        cannot be (another filesystem: `EXDEV`)."""
        with _opened(self.directory) as directory:
            target = file_io.open_directory(into, depth=1)
            try:
                while entries:
                    entry = entries[0]
                    os.rename(entry, entry, src_dir_fd=directory, dst_dir_fd=target)
                    entries.pop(0)
            finally:
                os.close(target)

    def remove_root(self) -> None:
        """Removes the directory if nothing else is left in it."""
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)


def _names(directory: str, prefix: str | tuple[str, ...] = "") -> list[str]:
    if os.path.islink(directory):
        raise ValueError(
            f"{directory!r} is a symlink; keras-ft follows no link in a "
            "backup directory. Replace the link by the directory it points to."
        )
    try:
        return [n for n in os.listdir(directory) if n.startswith(prefix)]
    except (FileNotFoundError, NotADirectoryError):
        return []


@contextlib.contextmanager
def _opened(path: str, create: bool = False) -> Iterator[int]:
    """The directory `path` as opened now, not through a symlink: what is
    created in it relative to this descriptor lands in it, even if its
    name is swapped for a link meanwhile."""
    if create:
        os.makedirs(path, exist_ok=True)
    fd = file_io.open_directory(path, depth=1)
    try:
        yield fd
    finally:
        os.close(fd)


def _rename(directory: str, old: str, new: str) -> None:
    """Renames `old` to `new`, both entries of `directory`, inside the
    directory as opened now: if its name was swapped for a link, nothing
    where the link points is renamed."""
    with _opened(directory) as fd:
        os.rename(
            _entry_of(directory, old),
            _entry_of(directory, new),
            src_dir_fd=fd,
            dst_dir_fd=fd,
        )


def _written_files(identity: str) -> file_io.WrittenFiles:
    # Shared on purpose by every store of a directory in this process: a
    # second fit() (a notebook cell run again) recycles what the first one
    # wrote. A handful of directories per process, each bounded.
    return holdings.setdefault("written", identity, file_io.WrittenFiles)


def _write_temporary(directory: int, name: str, data: bytes) -> str:
    """Writes `data` to a new file beside `name` in `directory`; its name."""
    temporary = f"{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o644, dir_fd=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:  # A full disk, say: leave nothing behind.
        with contextlib.suppress(OSError):
            os.remove(temporary, dir_fd=directory)
        raise
    return temporary


def _entry_of(directory: str, path: str) -> str:
    """The name of `path`, an entry of `directory`."""
    head, name = os.path.split(path)
    if os.path.normpath(head) != os.path.normpath(directory):
        raise ValueError(f"{path!r} is not an entry of {directory!r}.")
    return name


def _probe_write(directory: int) -> None:
    """Creates and removes a file in the directory open as `directory`."""
    if hasattr(os, "O_TMPFILE"):
        try:  # A file that never has a name: nothing to remove on a kill.
            os.close(os.open(".", os.O_WRONLY | os.O_TMPFILE, 0o600, dir_fd=directory))
            return
        except IsADirectoryError:  # The filesystem has no O_TMPFILE.
            pass
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                raise
    os.remove(_write_temporary(directory, ".keras-ft-probe", b""), dir_fd=directory)


def sweep_discarded(backup_dir: str) -> None:
    """Removes, in the background, what `LocalHousekeeping.discard()` moved out
    of `backup_dir` (and of this user's other backups, into the trash) and a
    killed process did not finish removing. Only directories: an entry of
    that name that is a link is left alone. One still being removed by a
    live process is removed twice over, harmlessly: both ignore what the
    other removed first."""
    if is_url(backup_dir):
        return
    parent, name = os.path.split(os.path.abspath(backup_dir))
    for place, prefix in (
        (parent, f".{name}{_DISCARDED}-"),
        (_trash(parent), _TRASH_ENTRY),
    ):
        if place is None:
            continue
        try:
            entries = [n for n in os.listdir(place) if n.startswith(prefix)]
        except OSError:
            continue
        pending = threads.pending_removals()
        for entry in entries:
            path = os.path.join(place, entry)
            if path not in pending and _is_directory(path):
                threads.remove_in_background(path, discard=True)


def _trash(near: str) -> str | None:
    """This user's trash directory, `<tempdir>/keras-ft-trash-<uid>`, made
    if missing, where it is on the filesystem of the directory `near` (a
    rename into it then works); `None` elsewhere, or where that name is not
    a directory of this user's that only this user can write (a link, or
    another user's)."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    trash = os.path.join(tempfile.gettempdir(), f"keras-ft-trash-{getuid()}")
    try:
        if os.stat(near).st_dev != os.stat(os.path.dirname(trash)).st_dev:
            return None
        with contextlib.suppress(FileExistsError):
            os.mkdir(trash, 0o700)
        found = os.lstat(trash)
    except OSError:
        return None
    mine = stat.S_ISDIR(found.st_mode) and found.st_uid == getuid()
    return trash if mine and not found.st_mode & 0o022 else None


def _is_directory(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove_tree(path: str) -> None:
    # A leftover that is a symlink goes, not what it points to.
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(OSError):
            os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
