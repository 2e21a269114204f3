"""How a checkpoint reaches disk, and how a reader knows it can trust one.

A checkpoint is a directory of files committed atomically: the files are
written into a staging directory, each one fsync'ed, a manifest with the size
and checksum of every file is written last, and the staging directory is
renamed to its final name. The rename is the commit: a reader only ever looks at
directories with a final name, and still verifies every checksum before it uses
one, so a torn write, a flipped bit or a deleted file is caught and the next
older checkpoint is used instead.

Checksums are XXH3-128 (`files.py`); the files' bytes reach the disk there.

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
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from keras_ft import threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NoGoodCheckpointError,
    SaveCancelled,
)
from keras_ft.checkpoint.files import ReadProgress, Staging

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "NoGoodCheckpointError",
    "ReadProgress",
    "RetentionPolicy",
    "SaveCancelled",
    "Staging",
    "checkpoint_name",
]

MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.json"
# A manifest entry's mark: the file's reader checks each piece it reads
# (sharded checkpoints), so a restore checks only its size.
PIECEWISE = "piecewise"
FORMAT_NAME = "keras-ft-checkpoint"
FORMAT_VERSION = 1

_T = TypeVar("_T")

# ASCII digits only, and few enough: a name from a backup is untrusted.
_CHECKPOINT_NAME = re.compile(r"ckpt-([0-9]{8,18})", re.ASCII)
_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
_SPARE_PREFIX = ".spare-"
# Files smaller than this are written anew rather than over a spare's.
# A manifest or metadata file larger than this is not one we wrote.
_MAX_JSON_BYTES = 64 * 1024 * 1024
# Notices are small JSON files with plain names, never a checkpoint's.
_NOTICE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\.json")
MAX_NOTICE_BYTES = 64 * 1024


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


def checkpoint_sequence(name: str) -> int | None:
    """The number of the checkpoint directory `name`, or `None` if `name` is
    not exactly one that `checkpoint_name()` gives (another digit set, a
    trailing newline, extra leading zeros, a number too long)."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return None
    sequence = int(match.group(1))
    return sequence if checkpoint_name(sequence) == name else None


class CheckpointStore:
    """Commits, lists, verifies and prunes checkpoints in one directory.

    Args:
        directory: Where committed checkpoints live. Created on first save.
        retention: What to keep after each commit, a `RetentionPolicy`, or
            `None` to keep everything. Defaults to `None`.
    """

    # What to do when a write fails, for the error that says so.
    write_error_fix = "Free some space or fix the directory's permissions"

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
            sequence = checkpoint_sequence(name)
            path = os.path.join(self.directory, name)
            # A real directory: a symlink named like one is not followed.
            if sequence is not None and _is_directory(path):
                found.append(Checkpoint(sequence, path))
        return sorted(found, key=lambda c: c.sequence)

    def verify(
        self,
        checkpoint: Checkpoint,
        progress: ReadProgress | None = None,
        whole: bool = True,
    ) -> dict[str, Any]:
        """Checks every file of `checkpoint` against its manifest.

        Args:
            checkpoint: The checkpoint to check.
            progress: Told how far each file has been read, if given.
            whole: If `False`, files the manifest marks `"piecewise"` (whose
                reader checks each piece it reads against its own checksum:
                a sharded checkpoint's pieces) are only checked for size.
                Defaults to `True`.

        Returns:
            The checkpoint's metadata dictionary.

        Raises:
            CorruptCheckpointError: naming what is wrong.
        """
        manifest = _read_json(checkpoint, MANIFEST_FILE)
        for name, expected in manifest_files(manifest, checkpoint.path).items():
            _verify_file(
                checkpoint,
                name,
                expected,
                progress,
                whole or not expected.get(PIECEWISE),
            )
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
            try:
                metadata, result = self.read(checkpoint, read)
            except CorruptCheckpointError as e:
                problems.append(str(e))
                warnings.warn(
                    f"{e}. Falling back to the previous checkpoint.", stacklevel=2
                )
                continue
            return checkpoint, metadata, result
        if candidates:
            raise NoGoodCheckpointError(
                f"None of the {len(candidates)} checkpoints in {self.directory} "
                "can be restored; nothing was deleted. Problems found:\n  "
                + "\n  ".join(problems)
                + "\nMove the directory away to start training from scratch."
            )
        return None

    def read(
        self,
        checkpoint: Checkpoint,
        read: Callable[[Checkpoint, ReadProgress], _T],
    ) -> tuple[dict[str, Any], _T]:
        """Verifies `checkpoint` while `read(checkpoint, progress)` reads it.

        See `latest_good_read()`; `read`'s result or error is handed on
        only if the checkpoint verifies.

        Returns:
            `(metadata, read(checkpoint, progress))`.

        Raises:
            CorruptCheckpointError: if `checkpoint` does not verify.
        """
        progress = ReadProgress()
        verifying = threads.submit(
            threads.verifier, self._verify_telling, checkpoint, progress
        )
        try:
            result, error = read(checkpoint, progress), None
        except Exception as e:  # Raised below if the checkpoint is good.
            result, error = None, e
        metadata = verifying.result()
        if error is not None:
            raise error
        return metadata, result

    def fetch(
        self,
        checkpoint: Checkpoint,
        read: Callable[[Checkpoint, ReadProgress], _T],
    ) -> tuple[Checkpoint, dict[str, Any], _T]:
        """`read()`, with the checkpoint to load from: here, `checkpoint`
        itself (a remote store returns a verified local copy)."""
        return (checkpoint, *self.read(checkpoint, read))

    # Notices: small files beside the checkpoints that every process of a
    # training reads (the cluster's preemption step). Never a checkpoint.

    def create_notice(self, name: str, data: bytes) -> bool:
        """Writes the notice `name` unless one exists: the first writer wins.

        Returns:
            Whether this call wrote it.
        """
        check_notice_name(name)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, name)
        temporary = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        with open(temporary, "wb") as f:
            f.write(data)
        try:
            os.link(temporary, path)  # Atomic, and fails if one exists.
        except FileExistsError:
            return False
        finally:
            os.remove(temporary)
        return True

    def read_notice(self, name: str) -> bytes | None:
        """The notice `name`, or `None` if there is none."""
        check_notice_name(name)
        try:
            with open(os.path.join(self.directory, name), "rb") as f:
                return f.read(MAX_NOTICE_BYTES)
        except FileNotFoundError:
            return None

    def remove_notice(self, name: str) -> None:
        check_notice_name(name)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.directory, name))

    def check_writable(self) -> None:
        """Creates the directory and a file in it, or raises naming it.

        Raises:
            ValueError: if the directory cannot be created or written.
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as e:
            raise ValueError(
                f"Invalid value for argument `backup_dir`: cannot write to "
                f"{self.directory!r} ({e.strerror or e}). Choose a directory "
                "this process can create and write."
            ) from e

    @property
    def identity(self) -> str:
        """The same for every store of this directory, whatever the path."""
        return os.path.realpath(self.directory)

    def writer_lock(self) -> Any:
        """The lock one writer holds (`acquire()`, `release(remove=False)`):
        an exclusive `flock` on the directory's `.lock`."""
        from keras_ft.checkpoint.lock import DirectoryLock

        return DirectoryLock(self.directory)

    def release(self, checkpoint: Checkpoint) -> None:
        """Done loading `checkpoint`: nothing to free on a local disk (an
        object store removes its download here)."""

    def url(self, checkpoint: Checkpoint) -> str:
        """Where `checkpoint` is, as users name it."""
        return checkpoint.path

    def _verify_telling(
        self, checkpoint: Checkpoint, progress: ReadProgress
    ) -> dict[str, Any]:
        try:
            # A reader checks what it reads of a piecewise file itself.
            return self.verify(checkpoint, progress, whole=False)
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
                files[name] = written.digests.get(name) or file_io.entry(path)
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
            unsynced = [n for n in (*files, MANIFEST_FILE) if n not in written.synced]
            file_io.fsync_together(
                [os.path.join(staging, n) for n in unsynced] + [staging]
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
            file_io.fsync_path(self.directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            if spare is not None:  # What of it was not reused.
                threads.remove_in_background(spare)
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
            if spare or not file_io.has_big_file(checkpoint.path):
                self._delete(checkpoint.path)
            else:
                # Renamed away from its committed name, so that no reader
                # can find it any more, and kept for the next save to reuse.
                name = f"{_SPARE_PREFIX}{secrets.token_hex(6)}"
                os.rename(checkpoint.path, os.path.join(self.directory, name))
                spare = True

    def leftovers(self) -> list[str]:
        """Staging, trash and spare directories: partial or deleted saves."""
        return [
            os.path.join(self.directory, n)
            for n in sorted(
                self._names((_STAGING_PREFIX, _TRASH_PREFIX, _SPARE_PREFIX))
            )
        ]

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
        threads.wait_for_removals()
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
        threads.remove_in_background(trash)

    def _next_sequence(self) -> int:
        committed = self.checkpoints()
        return committed[-1].sequence + 1 if committed else 1


# One thread removes deleted checkpoints; a kill leaves them as `.trash-*`
# directories, which `remove_leftovers()` clears at the next start.


def _is_directory(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def check_notice_name(name: str) -> None:
    if not _NOTICE_NAME.fullmatch(name):
        raise ValueError(f"Not a notice name: {name!r}.")


def manifest_files(manifest: Any, where: str) -> dict[str, dict[str, Any]]:
    """A manifest's `{file name: {"size": ..., algorithm: digest}}`, checked.

    Raises:
        CorruptCheckpointError: naming what is wrong with the manifest.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(where, "manifest has no format tag")
    if manifest.get("version") != FORMAT_VERSION:
        raise CorruptCheckpointError(
            where,
            f"manifest version {manifest.get('version')!r} is not "
            f"{FORMAT_VERSION}; written by another keras-ft release?",
        )
    body = {k: v for k, v in manifest.items() if k != "digest"}
    if manifest.get("digest") != _json_digest(body):
        raise CorruptCheckpointError(where, "manifest digest mismatch")
    files = manifest.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files:
        raise CorruptCheckpointError(where, "manifest lists no files")
    for name, expected in files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\\" in name
            or "\0" in name
        ):
            raise CorruptCheckpointError(
                where, f"manifest names a file outside the checkpoint: {name!r}"
            )
        algorithm = digest_algorithm(expected)
        if (
            algorithm is None
            or not isinstance(expected.get("size"), int)
            or not isinstance(expected.get(algorithm), str)
        ):
            raise CorruptCheckpointError(
                where, f"manifest entry for {name} is malformed"
            )
    return files


def digest_algorithm(entry: Any) -> str | None:
    """The checksum algorithm of a manifest entry, if one keras-ft knows."""
    if not isinstance(entry, dict):
        return None
    return next((a for a in file_io.DIGESTS if a in entry), None)


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
    name: str,
    expected: dict[str, Any],
    progress: ReadProgress | None = None,
    checksum: bool = True,
) -> None:
    algorithm = digest_algorithm(expected)
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
    if not checksum:
        return
    read = None if progress is None else functools.partial(progress.advance, name)
    if file_io.file_digest(path, algorithm, read) != expected[algorithm]:
        raise CorruptCheckpointError(
            checkpoint.path,
            f"{name} does not match its {file_io.DIGEST_NAMES[algorithm]} checksum",
        )
