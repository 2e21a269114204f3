"""The one storage protocol: how a checkpoint is committed, and how a reader
knows it can trust one, on a disk or in a bucket.

A checkpoint is a set of files committed atomically: the files are written
into a staging area, a manifest with the size and checksum of every file is
written last, and the storage commits (`local.py`: an fsync'ed rename of the
staging directory; `remote.py`: the manifest uploaded after every file). A
reader only ever looks at committed checkpoints, and still verifies every
checksum before it uses one, so a torn write, a flipped bit or a deleted file
is caught and the next older checkpoint is used instead. A checkpoint is
untrusted input: only the files its manifest lists are read, each size is
checked before a byte is read, and anything malformed is a damaged
checkpoint.

Everything here is written once, for every storage: staging, the manifest,
verification, the fallback to an older checkpoint, retention, notices. A
storage implements only the small interface `Storage` below; callers never
ask which one they have.

Checksums are XXH3-128 (`files.py`); the files' bytes reach the disk there.
This module knows nothing of Keras: it stores whatever files a writer puts into
the staging directory, plus a JSON metadata dictionary.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Protocol, TypeVar

from keras_ft import events, threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint import verify
from keras_ft.checkpoint.files import ReadProgress, Staging
from keras_ft.checkpoint.format import (
    MANIFEST_FILE,
    MAX_JSON_BYTES,
    MAX_NOTICE_BYTES,
    METADATA_FILE,
    Checkpoint,
    CommitTurn,
    RetentionPolicy,
    check_notice_name,
    checkpoint_name,
    checkpoint_sequence,
    chief_directory,
    is_notice_name,
    is_url,
    json_bytes,
    local_path,
    manifest_body,
    manifest_files,
    parse_json,
    signing_key,
)
from keras_ft.checkpoint.local import LocalStorage
from keras_ft.checkpoint.parts import Parts
from keras_ft.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NoGoodCheckpointError,
    SaveCancelled,
)

__all__ = [
    "MANIFEST_FILE",
    "METADATA_FILE",
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
    "Storage",
    "CheckpointReader",
    "Notices",
    "Housekeeping",
    "checkpoint_name",
    "checkpoint_sequence",
    "checkpoints_dir",
    "open_store",
]

_T = TypeVar("_T")


class Storage(Protocol):
    """Where checkpoints' bytes live: the small interface a storage implements.

    Two do: `LocalStorage` (a POSIX directory) and `ObjectStorage` (an fsspec
    bucket). A new one implements these and nothing of the protocol. Besides
    the commit's side below, a storage has three parts: `reader` (a
    `CheckpointReader`: what a restore reads), `notices` (`Notices`: small
    files beside the checkpoints) and `housekeeping` (`Housekeeping`: what
    is around them).
    """

    location: str  # The directory or URL, as users name it.
    write_error_fix: str  # What to do when a write fails.
    start_over_fix: str  # What to do when no checkpoint can be restored.
    reader: CheckpointReader
    notices: Notices
    housekeeping: Housekeeping

    @property
    def identity(self) -> str:
        """The same for every storage of one place, however it is named."""
        ...

    def url(self, checkpoint: Checkpoint) -> str: ...

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first."""
        ...

    def next_sequence(self) -> int:
        """The number the next checkpoint takes."""
        ...

    def parts(self, tag: str, sequence: int) -> Parts:
        """Where the processes' parts of the sharded save `tag` (to be
        committed as the checkpoint numbered `sequence`) wait for its
        commit (`keras_ft/checkpoint/parts.py`)."""
        ...

    def stage(
        self, cancel: threading.Event | None, pools: threads.Pools | None = None
    ) -> Staging:
        """A new local directory for a checkpoint's files, written and
        synced with the help of `pools` (a training's) if given."""
        ...

    def commit(
        self,
        staging: Staging,
        names: list[str],
        turn: CommitTurn,
    ) -> Checkpoint:
        """Makes the staged files `names` (manifest included) durable, calls
        `turn.take()`, then commits them under the next number, calling
        `turn.numbered()` with the checkpoint they become right before."""
        ...

    def unstage(self, staging: Staging) -> None:
        """Removes what `stage()` made, after a commit or a failure."""
        ...

    def retire(self, checkpoint: Checkpoint) -> None:
        """Lets a checkpoint retention no longer keeps go."""
        ...

    def delete(self, checkpoint: Checkpoint) -> None: ...

    def writer_lock(self) -> Any:
        """The lock one writer holds: `acquire()`, `check()` (raises if it
        may have been lost), `release(remove=False)`."""
        ...

    def check_writable(self) -> None: ...


class CheckpointReader(Protocol):
    """How a storage's checkpoints are read: regular files only."""

    # Whether a piecewise file is left in place on a restore, its reader
    # fetching the byte ranges it needs (`local_copy(ranged=...)`).
    ranged_reads: bool

    def names(self, checkpoint: Checkpoint) -> set[str]:
        """The names of the files stored in `checkpoint`."""
        ...

    def size(self, checkpoint: Checkpoint, name: str) -> int:
        """A file's size; `FileNotFoundError` if it is not a regular file."""
        ...

    def digest(
        self,
        checkpoint: Checkpoint,
        name: str,
        algorithm: str,
        read: Callable[[int], None] | None = None,
    ) -> str: ...

    def open_file(self, checkpoint: Checkpoint, name: str) -> IO[bytes]:
        """A file of `checkpoint`, open for reading (regular files only)."""
        ...

    def read_bytes(self, checkpoint: Checkpoint, name: str, limit: int) -> bytes:
        """A small file's bytes; `ValueError` if over `limit` or not a
        regular file, `FileNotFoundError` if missing."""
        ...

    def local_copy(
        self,
        checkpoint: Checkpoint,
        sizes: dict[str, int],
        stream: frozenset[str] = frozenset(),
        ranged: frozenset[str] = frozenset(),
    ) -> Checkpoint:
        """A local directory holding the files to load from (`sizes`: their
        names and sizes in the manifest); those in `stream` may still be
        arriving (see `copy_reader()`), those in `ranged` may be left where
        they are, read by ranges (with `ranged_reads`)."""
        ...

    def copy_reader(self, local: Checkpoint) -> CheckpointReader:
        """The reader of `local`'s files (waiting for the bytes of files
        still arriving)."""
        ...

    def release(self, local: Checkpoint) -> None:
        """Frees a `local_copy()` once it is loaded."""
        ...


class Notices(Protocol):
    """Small files beside the checkpoints that every process of a training
    reads (plain names: `format.is_notice_name()`)."""

    def create(self, name: str, data: bytes) -> bool:
        """Writes `name` unless it exists; whether this call wrote it."""
        ...

    def read(self, name: str, limit: int) -> bytes | None:
        """At most `limit` bytes of `name`; `None` if there is none."""
        ...

    def replace(self, name: str, data: bytes) -> None:
        """Writes `name` whole, replacing it (readers see old or new)."""
        ...

    def remove(self, name: str) -> None: ...

    def names(self) -> list[str]:
        """The names of the regular files (objects) beside the checkpoints."""
        ...


class Housekeeping(Protocol):
    """What is around a storage's checkpoints."""

    def scratch_dir(self, name: str) -> str:
        """A local directory for this process's throwaway files."""
        ...

    def usage(self, path: str) -> int:
        """Bytes stored below `path`."""
        ...

    def leftovers(self) -> list[str]:
        """What partial or deleted saves left."""
        ...

    def foreign(self) -> list[str]:
        """Entries named like leftovers that no save made (a symlink)."""
        ...

    def remove_leftovers(self) -> None: ...

    def discard(self, beside: str) -> bool:
        """Moves every checkpoint and leftover out, to be removed in the
        background; returns whether it did (else nothing, or part, moved)."""
        ...

    def remove_root(self) -> None:
        """Removes the (emptied) directory itself, where there is one."""
        ...


def open_storage(
    location: str,
    storage_options: dict | None = None,
    progress: Any = None,
) -> Storage:
    """The storage at `location`: a local directory, or an fsspec URL."""
    if is_url(location):
        from keras_ft.checkpoint.remote import ObjectStorage

        return ObjectStorage(location, storage_options, progress)
    return LocalStorage(local_path(location))


class CheckpointStore:
    """Commits, lists, verifies and prunes checkpoints in one place.

    Args:
        directory: Where committed checkpoints live: a directory (created on
            first save) or an fsspec URL (`s3://bucket/run/chief`).
        retention: What to keep after each commit, a `RetentionPolicy`, or
            `None` to keep everything. Defaults to `None`.
        storage_options: With a URL, options for its fsspec filesystem.
            Defaults to `None`.
        progress: The stream long transfers draw their progress on, where
            it is a terminal: a bucket's uploads and downloads, a disk's
            restores. Defaults to `None`.
        storage: The `Storage` to use instead of the one `directory` names.
            Defaults to `None`.
        inspect: Called by `verify()` as `inspect(metadata, open_file,
            where)` once the checksums match, to check what the files hold
            (`open_file(name)` opens one for reading); raises
            `CorruptCheckpointError` for contents the writer's format does not
            allow. Defaults to `None`: checksums only.
        manifest_key: A secret (string or bytes): every manifest written is
            signed with it (HMAC-SHA256), and a checkpoint whose manifest is
            unsigned or signed otherwise is refused as damaged. For a backup
            others can write to. Defaults to `None`: the environment's
            `KERAS_FT_MANIFEST_KEY`, if set, else no signatures.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        retention: RetentionPolicy | None = None,
        *,
        storage_options: dict | None = None,
        progress: Any = None,
        storage: Storage | None = None,
        manifest_key: str | bytes | None = None,
        inspect: Callable[[dict, Callable[[str], IO[bytes]], str], None] | None = None,
    ):
        self._key = signing_key(manifest_key)
        self._inspect = inspect
        self.progress = progress
        self.storage = storage or open_storage(
            os.fspath(directory), storage_options, progress
        )
        self.directory = self.storage.location
        self.retention = retention

    def __repr__(self) -> str:
        return f"CheckpointStore({self.directory!r})"

    @property
    def identity(self) -> str:
        return self.storage.identity

    @property
    def write_error_fix(self) -> str:
        return self.storage.write_error_fix

    def url(self, checkpoint: Checkpoint) -> str:
        """Where `checkpoint` is, as users name it (a loaded local copy of
        a bucket's checkpoint included)."""
        return self.storage.url(checkpoint)

    def writer_lock(self) -> Any:
        """The lock one writer holds: a `flock` on disk, a lease in a bucket."""
        return self.storage.writer_lock()

    def check_writable(self) -> None:
        """Fails early if saves could not be written; changes nothing else.

        Raises:
            ValueError: naming the directory or URL.
        """
        self.storage.check_writable()

    # Reading.

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first. Unverified."""
        return self.storage.checkpoints()

    def leftovers(self) -> list[str]:
        """What partial or deleted saves left (never a checkpoint)."""
        return self.storage.housekeeping.leftovers()

    def foreign(self) -> list[str]:
        """Entries named like leftovers that no save made (a symlink): never
        followed, removed with the leftovers."""
        return self.storage.housekeeping.foreign()

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
        files = self._manifest(checkpoint)
        verify.check_names(self.storage.reader, checkpoint, files)
        metadata = verify.check_files(
            self.storage.reader, checkpoint, files, progress, whole
        )
        self._inspected(self.storage.reader, checkpoint, metadata, checkpoint.path)
        return metadata

    def _inspected(
        self,
        reader: CheckpointReader,
        checkpoint: Checkpoint,
        metadata: dict,
        where: str,
    ) -> None:
        """Runs `inspect` (see the class), if there is one, on a verified
        checkpoint."""
        if self._inspect is None:
            return
        try:
            self._inspect(
                metadata, lambda name: reader.open_file(checkpoint, name), where
            )
        except (OSError, ValueError) as e:
            raise CorruptCheckpointError(
                where, f"its contents cannot be read ({e})"
            ) from None

    def manifest(self, checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
        """The files `checkpoint`'s manifest lists, with their entries (size
        and checksum), read and its signature checked, the files not.

        Raises:
            CorruptCheckpointError: if the manifest is unreadable or forged.
        """
        return self._manifest(checkpoint)

    def _manifest(self, checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
        data = verify.read_small(self.storage.reader, checkpoint, MANIFEST_FILE)
        return manifest_files(
            parse_json(data, checkpoint.path, MANIFEST_FILE), checkpoint.path, self._key
        )

    def latest_good(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """The newest checkpoint that verifies, with its metadata.

        Damaged checkpoints are skipped with a warning and left in place.

        Returns:
            `(checkpoint, metadata)`, or `None` if there is no checkpoint.

        Raises:
            NoGoodCheckpointError: if checkpoints exist but none verifies.
        """
        return self._newest_good(None)

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
        The checkpoint returned is the one to load from (in a bucket, a local
        copy): `release()` it once loaded.

        Returns:
            `(checkpoint, metadata, read(checkpoint))`, or `None` if there is
            no checkpoint.

        Raises:
            NoGoodCheckpointError: if checkpoints exist but none verifies.
        """
        return self._newest_good(read)

    def _newest_good(
        self, read: Callable[[Checkpoint, ReadProgress], _T] | None
    ) -> tuple | None:
        """The newest checkpoint that verifies (`fetch()`ed with `read`, if
        given), falling back past damaged ones."""
        candidates = self.checkpoints()
        problems = []
        for checkpoint in reversed(candidates):
            try:
                if read is None:
                    return checkpoint, self.verify(checkpoint)
                return self.fetch(checkpoint, read)
            except CorruptCheckpointError as e:
                problems.append(str(e))
                events.warn(
                    "restore",
                    f"{e}. Falling back to the previous checkpoint.",
                    stacklevel=3,
                )
        if candidates:
            raise NoGoodCheckpointError(
                f"None of the {len(candidates)} checkpoints in {self.directory} "
                "can be restored; nothing was deleted. Problems found:\n  "
                + "\n  ".join(problems)
                + "\n"
                + self.storage.start_over_fix
            )
        return None

    def fetch(
        self,
        checkpoint: Checkpoint,
        read: Callable[[Checkpoint, ReadProgress], _T],
    ) -> tuple[Checkpoint, dict[str, Any], _T]:
        """Verifies `checkpoint` while `read(checkpoint, progress)` reads it.

        See `latest_good_read()`; `read`'s result or error is handed on
        only if the checkpoint verifies.

        Returns:
            `(the checkpoint to load from, metadata, read's result)`:
            `release()` the first once loaded.

        Raises:
            CorruptCheckpointError: if `checkpoint` does not verify.
        """
        files = self._manifest(checkpoint)
        return verify.fetch(
            self.storage.reader, checkpoint, files, read, self.progress, self._inspected
        )

    def release(self, checkpoint: Checkpoint) -> None:
        """Done loading a checkpoint `fetch()` returned: a bucket's download
        is removed (arrays mapped from it stay valid)."""
        self.storage.reader.release(checkpoint)

    def usage(self, path: str) -> int:
        """Bytes stored below `path` (a checkpoint or a leftover)."""
        try:
            return self.storage.housekeeping.usage(path)
        except OSError:
            return 0

    def unverified_metadata(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """A checkpoint's metadata, read without verifying anything (what a
        damaged checkpoint says of itself, for people); `{}` if unreadable."""
        try:
            data = self.storage.reader.read_bytes(
                checkpoint, METADATA_FILE, MAX_JSON_BYTES
            )
            value = parse_json(data, checkpoint.path, METADATA_FILE)
        except (OSError, ValueError, CorruptCheckpointError):
            return {}
        return value if isinstance(value, dict) else {}

    # Notices: small files beside the checkpoints that every process of a
    # training reads (the cluster's preemption step). Never a checkpoint.

    def create_notice(self, name: str, data: bytes) -> bool:
        """Writes the notice `name` unless one exists: the first writer wins
        (on disk a hard link; in a bucket a conditional put where the store
        has one).

        Returns:
            Whether this call wrote it.
        """
        check_notice_name(name)
        return self.storage.notices.create(name, data)

    def read_notice(self, name: str) -> bytes | None:
        """The notice `name`, or `None` if there is none (or it is not a
        regular file)."""
        check_notice_name(name)
        try:
            return self.storage.notices.read(name, MAX_NOTICE_BYTES)
        except ValueError:
            return None

    def remove_notice(self, name: str) -> None:
        check_notice_name(name)
        self.storage.notices.remove(name)

    def replace_notice(self, name: str, data: bytes) -> None:
        """Writes the notice `name`, replacing it: a reader sees the old one
        or the new one, whole (a rename on disk, one PUT in a bucket)."""
        check_notice_name(name)
        self.storage.notices.replace(name, data)

    def notices(self, prefix: str = "") -> list[str]:
        """The names of the notices starting with `prefix`, sorted."""
        return sorted(
            n
            for n in self.storage.notices.names()
            if n.startswith(prefix) and is_notice_name(n)
        )

    # Writing.

    def save(
        self,
        write_files: Callable[[Staging], None],
        metadata: dict[str, Any],
        cancel: threading.Event | None = None,
        *,
        lock: Any = None,
        supersedes: Checkpoint | None = None,
        committing: Callable[[Checkpoint, dict], None] | None = None,
        pools: threads.Pools | None = None,
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
            lock: The writer's lock or lease, checked once the files are
                written and durable, before the checkpoint gets its number
                (a lapsed lease: another writer may commit). Defaults to
                `None`.
            supersedes: The checkpoint this one replaces, deleted once this
                one is committed and before retention runs, so that it
                takes no older checkpoint's place. Defaults to `None`.
            committing: Called as `committing(checkpoint, metadata)` right
                before the commit makes `checkpoint` visible: a note of what
                is being committed, written there, is never later than the
                commit. Defaults to `None`.
            pools: The helper threads that checksum and fsync the files (the
                training's). Defaults to `None`: the writer thread does it.

        Returns:
            The committed checkpoint.
        """
        staging = self.storage.stage(cancel, pools)
        try:
            write_files(staging)
            staging.write_file(METADATA_FILE, [json_bytes(metadata)])
            files = {}
            through = os.fspath(staging)  # As opened (see `Staging`).
            for name in sorted(os.listdir(through)):
                path = os.path.join(through, name)
                if not os.path.isfile(path) or os.path.islink(path):
                    raise ValueError(
                        f"A checkpoint holds plain files only; {name!r} is not one."
                    )
                files[name] = staging.digests.get(name) or file_io.entry(path)
            files.update(staging.in_place)
            for name in staging.from_paths:  # Their entries come with them.
                files[name] = staging.digests[name]
            with open(os.path.join(through, MANIFEST_FILE), "wb") as f:
                # Indented: people read manifests too.
                body = manifest_body(files, time.time(), self._key)
                f.write(json_bytes(body, indent=1))
            turn = CommitTurn(lock, committing, metadata)
            committed = self.storage.commit(staging, [*files, MANIFEST_FILE], turn)
        finally:
            self.storage.unstage(staging)
        events.log(
            "save",
            f"committed {committed.path} (epoch {metadata.get('epochs_completed')}, "
            f"batch {metadata.get('batches_completed')}, "
            f"step {metadata.get('step')})",
        )
        try:  # Committed: a failed clean-up is retried after the next commit.
            if supersedes is not None:
                # Gone already if retention or another clean-up took it.
                with contextlib.suppress(FileNotFoundError):
                    self.storage.delete(supersedes)
            self.prune()
        except Exception as e:  # Any storage's error.
            events.warn(
                "save",
                f"keras-ft: {committed.path} is committed, but deleting older "
                f"checkpoints failed ({type(e).__name__}: {e}); retried later.",
                stacklevel=2,
            )
        return committed

    def prune(self) -> None:
        """Lets go of the checkpoints the retention policy selects (never
        the newest)."""
        if self.retention is None:
            return
        committed = self.checkpoints()
        for checkpoint in self.retention.select_for_deletion(committed):
            if checkpoint != committed[-1]:
                self.storage.retire(checkpoint)

    def delete(self, checkpoint: Checkpoint) -> None:
        """Deletes one committed checkpoint."""
        self.storage.delete(checkpoint)

    def remove_leftovers(self) -> None:
        """Removes what partial or deleted saves left. Only for the holder
        of the writer lock: another writer's save in flight is a leftover
        too."""
        self.storage.housekeeping.remove_leftovers()

    def clear(self, beside: str | None = None) -> None:
        """Deletes every checkpoint and leftover this store made.

        Other files are left alone; the directory itself is removed only if
        that leaves it empty.

        Args:
            beside: `backup_dir`, on a disk: the checkpoints are moved out
                beside it and removed in the background, not waited for.
                Defaults to `None`: deleted here, waited for.
        """
        if beside is None or not self.storage.housekeeping.discard(beside):
            for checkpoint in self.checkpoints():
                self.storage.delete(checkpoint)
            threads.wait_for_removals()
            self.storage.housekeeping.remove_leftovers()
        for name in self.notices():
            self.storage.notices.remove(name)
        self.storage.housekeeping.remove_root()


def open_store(
    path: str,
    retention: RetentionPolicy | None = None,
    storage_options: dict | None = None,
    progress: Any = None,
    manifest_key: str | bytes | None = None,
) -> CheckpointStore:
    """The store of checkpoints at `path`: a local directory or a URL
    (`storage_options` and upload `progress` apply to a URL's)."""
    return CheckpointStore(
        path,
        retention,
        storage_options=storage_options,
        progress=progress,
        manifest_key=manifest_key,
    )


def locate(
    where: str,
    storage_options: dict | None = None,
    inspect: Callable[[dict, Callable[[str], IO[bytes]], str], None] | None = None,
) -> tuple[CheckpointStore, Checkpoint | None]:
    """The store of a backup (`backup_dir`, or the directory of checkpoints
    itself) and `None`, or of one checkpoint of it and that checkpoint: in
    a bucket or on this disk, whichever `where` names.

    Raises:
        CheckpointError: if `where` is on this disk and is neither.
    """
    path = where.rstrip("/") or where
    parent, _, name = path.rpartition("/")
    sequence = checkpoint_sequence(name)
    if is_url(path):
        at = parent if sequence is not None else checkpoints_dir(path)
        store = CheckpointStore(at, storage_options=storage_options, inspect=inspect)
        return store, None if sequence is None else Checkpoint(sequence, path)
    path = local_path(path)
    if os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        found = Checkpoint(sequence or 0, path)
        return CheckpointStore(os.path.dirname(path), inspect=inspect), found
    if not os.path.isdir(path):
        missing = "" if os.path.exists(path) else "does not exist: it "
        raise CheckpointError(
            f"{path!r} {missing}is neither a keras-ft checkpoint nor a backup "
            "directory."
        )
    return CheckpointStore(checkpoints_dir(path), inspect=inspect), None


def checkpoints_dir(path: str) -> str:
    """A backup directory's checkpoints: in `chief/`, or in `path` itself."""
    chief = chief_directory(path)
    if is_url(path):
        return chief
    path = local_path(path)
    return chief if os.path.isdir(chief) or not os.path.isdir(path) else path
