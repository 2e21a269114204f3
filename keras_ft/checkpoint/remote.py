"""Checkpoints in object storage (S3, GCS, ...), through fsspec.

An object store has no atomic rename of a directory, so the commit is another
one: a checkpoint's files are uploaded first, under `<prefix>/ckpt-<n>/`, and
its manifest (the size and checksum of every file) last, as one object. A
reader trusts only a checkpoint whose manifest exists and verifies, and
verifies each file against it; a checkpoint directory without a manifest is a
partial upload (a writer killed mid-upload), never read, removed by the next
writer. Old checkpoints are deleted only after a newer one is committed,
manifest first, so that a half-deleted one is never taken for a good one.

The storage protocol (`store.py`) stages a checkpoint's files in a local
temporary directory, the same bytes and manifest as on disk; this module
uploads them. A restore downloads the files the manifest lists into a local
directory, verifies them there and loads them like a local checkpoint, and
the download is removed once loaded, so a resume on a new machine needs
nothing but the bucket.

One writer per prefix: there is no `flock` on a bucket, so the writer holds a
lease, an object `.lease.json` with its host, pid and a heartbeat it renews
every few seconds. Another writer may take it over only when the heartbeat
is older than `KERAS_FT_LEASE_SECONDS` (default 30), or when the holder is a
process on the same host that no longer runs.

On S3 (and servers of its protocol) every write of the lease is conditional:
created only if absent (`If-None-Match: *`), replaced only if unchanged since
it was read (`If-Match: <ETag>`), so two writers can never both hold it,
whatever their timing, and a heartbeat never writes over a lease taken over;
a manifest is created only if absent, so no two writers both commit a
checkpoint number. Other stores have no such writes that fsspec passes on:
there the lease is written, read back after a pause, and the last writer
wins (best effort: two writers within one round trip may both write), which
keras-ft says once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import secrets
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any

from keras_ft import events, threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint import scratch, transfers
from keras_ft.checkpoint.downloads import LocalCopies
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import (
    MANIFEST_FILE,
    PIECEWISE,
    Checkpoint,
    CommitTurn,
    checkpoint_name,
    checkpoint_sequence,
    is_url,
)
from keras_ft.checkpoint.lease import (  # noqa: F401  (also named here, as before)
    LEASE_FILE,
    LEASE_SECONDS_ENV,
    Refused,
    RemoteLease,
    conditional_writes,
    put_if,
)
from keras_ft.checkpoint.local import LocalReader
from keras_ft.errors import (
    LeaseLapsedError,
    SaveCancelled,
)

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# Options, beside any "*endpoint*", that pick the server a URL is on.
_SERVER_KEYS = ("host", "hostname", "port", "account_name", "account_url")
# Environment variables that point a scheme's client at another server.
_ENDPOINT_ENV = {
    "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "s3a": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "gs": ("STORAGE_EMULATOR_HOST",),
    "gcs": ("STORAGE_EMULATOR_HOST",),
}


def check_storage_options(backup_dir: str, storage_options: object) -> dict | None:
    """`storage_options` checked: a dict or `None`; with a URL `backup_dir`,
    its filesystem is opened now, to fail early if it is missing."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ValueError(
            "Invalid value for argument `storage_options`. Expected a dict of "
            "fsspec filesystem options. Received: "
            f"storage_options={storage_options!r}"
        )
    if is_url(backup_dir):
        filesystem(backup_dir, storage_options)
    return storage_options


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """`(fsspec filesystem, path in it)` for `url`, or a clear error."""
    scheme = url.partition("://")[0]
    extra = _EXTRAS.get(scheme)
    hint = f"pip install 'keras-ft[{extra}]'" if extra else "pip install fsspec"
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"keras-ft needs fsspec for a backup_dir like {url!r}: {hint}"
        ) from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        raise ImportError(
            f"keras-ft cannot open {url!r}: the filesystem package for "
            f"{scheme}:// is not installed ({e}). Install it: {hint}"
        ) from None
    except ValueError as e:
        raise ValueError(
            f"Invalid value for argument `backup_dir`: fsspec knows no "
            f"filesystem for {url!r} ({e}). Received: backup_dir={url!r}"
        ) from None


def server_of(url: str, storage_options: dict | None) -> str:
    """What names the server `url` is on, beyond the URL: every option
    that names an endpoint, host, port or account (at any depth), and the
    environment's endpoint for the scheme; "" for the scheme's default.
    Credentials are left out (the same objects, whoever reads them), and
    so is any value that is not a plain string or number (its text may
    differ from process to process)."""
    found: list[str] = []

    def walk(options: Any, path: str) -> None:
        if not isinstance(options, dict):
            return
        for key in sorted(options, key=str):
            value, name = options[key], f"{path}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            elif isinstance(value, (str, int, float)) and _names_server(str(key)):
                found.append(f"{name}={value}")

    walk(storage_options, "")
    scheme = url.partition("://")[0]
    for variable in _ENDPOINT_ENV.get(scheme, ()):
        if os.environ.get(variable):
            found.append(f"${variable}={os.environ[variable]}")
            break  # The first one set is the one the client uses.
    return " ".join(found)


def _names_server(key: str) -> bool:
    key = key.lower()
    return "endpoint" in key or key in _SERVER_KEYS


class ObjectStorage:
    """Checkpoints under one prefix of an fsspec filesystem; the manifest,
    uploaded last, is the commit.

    What a restore reads is `reader` (an `ObjectReader`), the objects
    beside the checkpoints are `notices` (`ObjectNotices`), and what is
    around them is `housekeeping` (`ObjectHousekeeping`).

    Args:
        url: Where committed checkpoints live (`s3://bucket/run/chief`).
        storage_options: Passed to fsspec. Defaults to `None`.
        progress: If set, the stream (standard output) an upload or download
            that lasts `progress_after` seconds or more draws its progress
            on, where it is a terminal (`events.Progress`). Defaults to
            `None`: none shown.
        progress_after: Seconds before a transfer's progress shows.
            Defaults to `events.PROGRESS_AFTER` (2).
    """

    write_error_fix = "Check that the bucket is reachable and the credentials valid"
    start_over_fix = "Remove the prefix to start training from scratch."

    def __init__(
        self,
        url: str,
        storage_options: dict | None = None,
        progress: Any = None,
        progress_after: float | None = None,
    ):
        self.location = url.rstrip("/")
        self.fs, root = filesystem(self.location, storage_options)
        # The same URL on two servers is two backups.
        self.server = server_of(self.location, storage_options)
        self.root = root.rstrip("/")
        # 12 hex digits for local names made for this backup (a scratch
        # directory, a local tier): one backup, one name.
        self.digest_name = hashlib.sha1(self.identity.encode()).hexdigest()[:12]
        self.progress = progress
        self.progress_after = progress_after
        # Downloads still arriving, by local copy.
        self._copies = LocalCopies(self)  # A restore's downloads.
        self.reader = ObjectReader(self)
        self.notices = ObjectNotices(self)
        self.housekeeping = ObjectHousekeeping(self)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.location!r})"

    @property
    def identity(self) -> str:
        """The URL, and the server when not the scheme's default."""
        return f"{self.location} on {self.server}" if self.server else self.location

    def url(self, checkpoint: Checkpoint) -> str:
        """Where `checkpoint` is in the bucket (its downloaded copy's too)."""
        return self._path(checkpoint.sequence)

    def _path(self, sequence: int) -> str:
        return f"{self.location}/{checkpoint_name(sequence)}"

    def _key(self, checkpoint: Checkpoint, name: str = "") -> str:
        key = f"{self.root}/{checkpoint_name(checkpoint.sequence)}"
        return f"{key}/{name}" if name else key

    # Listing.

    def _listing(self) -> dict[int, set[str]]:
        """`{sequence: names of the files}` of every checkpoint prefix."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self.root)
        try:
            paths = self.fs.find(self.root)
        except FileNotFoundError:
            return {}
        found: dict[int, set[str]] = {}
        for path in paths:
            relative = path[len(self.root) :].strip("/").split("/")
            if len(relative) == 2:
                sequence = checkpoint_sequence(relative[0])
                if sequence is not None:
                    found.setdefault(sequence, set()).add(relative[1])
        return found

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints (their manifest is there), oldest first."""
        return [
            Checkpoint(sequence, self._path(sequence))
            for sequence, names in sorted(self._listing().items())
            if MANIFEST_FILE in names
        ]

    # Writing: files staged locally, uploaded, the manifest last.

    def stage(
        self, cancel: threading.Event | None, pools: threads.Pools | None = None
    ) -> Staging:
        path = scratch.make("upload")
        return Staging(path, cancel, sync=False, pools=pools)  # Uploaded.

    def commit(
        self,
        staging: Staging,
        names: list[str],
        turn: CommitTurn,
    ) -> Checkpoint:
        """Uploads the staged files concurrently, then the manifest: the
        commit. What was uploaded of a failed or called-off commit is
        removed; an upload that fails after retries is an `OSError`."""
        turn.take()
        staging.check_cancelled()
        sequence = staging.sequence
        if sequence is None:
            sequence = self.next_sequence()
        committed = Checkpoint(sequence, self._path(sequence))
        local = functools.partial(os.path.join, staging.path)
        paths = {
            n: staging.from_paths.get(n) or local(n)
            for n in names
            if n != MANIFEST_FILE and n not in staging.in_place
        }
        shown = self._progress_of(
            "save", f"uploading {committed.name}",
            sum(os.path.getsize(p) for p in paths.values()),
        )  # fmt: skip
        try:
            uploading = threads.Pool(threads.TRANSFERS, "keras-ft-transfer")
            try:
                uploads = [
                    threads.submit(
                        uploading, self._upload, path,
                        self._key(committed, n), staging.cancel, shown,
                    )
                    for n, path in paths.items()
                ]  # fmt: skip
                for upload in uploads:
                    upload.result()
            finally:
                uploading.close()  # None goes on past a failed commit.
            if shown is not None:
                shown.close()
            staging.check_cancelled()
            turn.numbered(committed)
            self._commit_manifest(local(MANIFEST_FILE), committed)
        except Refused:
            raise LeaseLapsedError(
                errno.EBUSY,
                f"{self._path(sequence)} was committed by another writer while "
                "this one uploaded it (two trainings on one backup_dir): this "
                "save is not committed, and the other's checkpoint is left as it "
                "is. Stop one of the two trainings.",
            ) from None
        except BaseException:
            self._remove(committed, ignore_errors=True)
            raise
        return committed

    def next_sequence(self) -> int:
        """The number the next checkpoint takes: past every prefix there is,
        partial uploads included."""
        listing = transfers.as_os_error(self._listing, f"listing {self.location}")
        return max(listing, default=0) + 1

    def parts(self, tag: str, sequence: int) -> RemoteParts:
        """Where the processes' parts of a sharded save go: straight into
        the checkpoint numbered `sequence` (`tag` unused), which the chief's
        manifest commits in place."""
        return RemoteParts(self, sequence)

    def _commit_manifest(self, path: str, committed: Checkpoint) -> None:
        """Uploads the manifest; where the store can, only if there is none."""
        key = self._key(committed, MANIFEST_FILE)
        if not conditional_writes(self.fs):
            self._upload(path, key)
            return
        with open(path, "rb") as f:
            data = f.read()
        transfers.as_os_error(lambda: put_if(self.fs, key, data), f"upload of {key}")

    def unstage(self, staging: Staging) -> None:
        scratch.remove(staging.path)

    def _upload(
        self,
        path: str,
        key: str,
        cancel: threading.Event | None = None,
        shown: events.Progress | None = None,
    ) -> None:
        if cancel is not None and cancel.is_set():
            raise SaveCancelled()
        callback = transfers.moves(shown)
        transfers.as_os_error(
            lambda: self.fs.put_file(path, key, callback=callback),
            f"upload of {key}",
        )

    def _progress_of(self, kind: str, what: str, total: int) -> events.Progress | None:
        """The progress line of a checkpoint's transfer (see `progress`)."""
        if self.progress is None:
            return None
        return events.Progress(
            kind, f"keras-ft: {what}", total, self.progress_after, self.progress
        )

    def retire(self, checkpoint: Checkpoint) -> None:
        self.delete(checkpoint)

    def delete(self, checkpoint: Checkpoint) -> None:
        """Deletes one checkpoint: its manifest first, so that it is never
        taken for a good one half deleted."""
        self._remove(checkpoint)

    def _remove(self, checkpoint: Checkpoint, ignore_errors: bool = False) -> None:
        try:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._key(checkpoint, MANIFEST_FILE))
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._key(checkpoint), recursive=True)
        except OSError:
            if not ignore_errors:
                raise

    # One writer.

    def writer_lock(self) -> RemoteLease:
        """A lease object with a heartbeat."""
        return RemoteLease(self)

    def check_writable(self) -> None:
        """Writes and removes a small object, or raises naming the URL."""
        probe = f"{self.root}/.probe-{secrets.token_hex(6)}"
        try:
            with contextlib.suppress(Exception):
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"keras-ft")
            self.fs.rm_file(probe)
        except Exception as e:  # Any backend's error: say which URL.
            raise ValueError(
                f"Invalid value for argument `backup_dir`: cannot write to "
                f"{self.location!r} ({type(e).__name__}: {e}). Check the bucket "
                "exists and the credentials (fsspec's configuration, or "
                "`storage_options=`)."
            ) from e


class ObjectReader:
    """Reads a bucket's checkpoints: checksums streamed, a restore's files
    downloaded into a local copy (`LocalCopies`)."""

    ranged_reads = True

    def __init__(self, storage: ObjectStorage):
        self._fs, self._key, self._copies = storage.fs, storage._key, storage._copies

    def names(self, checkpoint: Checkpoint) -> set[str]:
        prefix = self._key(checkpoint)
        with contextlib.suppress(AttributeError):
            self._fs.invalidate_cache(prefix)
        return {
            path[len(prefix) :].strip("/")
            for path in self._fs.find(prefix)
            if path.startswith(prefix + "/")
        }

    def size(self, checkpoint: Checkpoint, name: str) -> int:
        return int(self._fs.size(self._key(checkpoint, name)))

    def digest(
        self,
        checkpoint: Checkpoint,
        name: str,
        algorithm: str,
        read: Callable[[int], None] | None = None,
    ) -> str:
        """The object's checksum, streamed: nothing is stored locally."""
        digest = file_io.DIGESTS[algorithm]()
        done = 0
        with self._fs.open(self._key(checkpoint, name), "rb", block_size=8 << 20) as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
                done += len(chunk)
                if read is not None:
                    read(done)
        return digest.hexdigest()

    def open_file(self, checkpoint: Checkpoint, name: str) -> IO[bytes]:
        return self._fs.open(self._key(checkpoint, name), "rb", block_size=1 << 20)

    def read_bytes(self, checkpoint: Checkpoint, name: str, limit: int) -> bytes:
        # A listing of this prefix cached while it was being uploaded
        # would hide the files uploaded since (fsspec keeps one per prefix).
        with contextlib.suppress(AttributeError):
            self._fs.invalidate_cache(self._key(checkpoint))
        with self._fs.open(self._key(checkpoint, name), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{name} is too large (at most {limit} bytes are read)")
        return data

    def local_copy(
        self,
        checkpoint: Checkpoint,
        sizes: dict[str, int],
        stream: frozenset[str] = frozenset(),
        ranged: frozenset[str] = frozenset(),
    ) -> Checkpoint:
        """A local copy of `checkpoint` for a restore (`LocalCopies.make()`)."""
        return self._copies.make(checkpoint, sizes, stream, ranged)

    def copy_reader(self, local: Checkpoint) -> LocalReader:
        return self._copies.reader(local)

    def release(self, local: Checkpoint) -> None:
        self._copies.release(local)


class ObjectNotices:
    """Small objects beside a bucket's checkpoints that every process of a
    training reads."""

    def __init__(self, storage: ObjectStorage):
        self._fs, self._root = storage.fs, storage.root

    def create(self, name: str, data: bytes) -> bool:
        """Writes `name` unless it exists: the first writer wins where the
        store has a conditional create (S3's `If-None-Match`, what fsspec's
        `mode="create"` asks for); elsewhere fsspec checks, then writes, and
        two writers within one round trip may both write."""
        try:
            transfers.retried(lambda: put_if(self._fs, f"{self._root}/{name}", data))
        except Refused:
            return False
        return True

    def read(self, name: str, limit: int) -> bytes | None:
        with contextlib.suppress(AttributeError):
            self._fs.invalidate_cache(self._root)
        try:
            with self._fs.open(f"{self._root}/{name}", "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(f"{self._root}/{name}")

    def replace(self, name: str, data: bytes) -> None:
        transfers.as_os_error(
            lambda: self._fs.pipe_file(f"{self._root}/{name}", data), f"writing {name}"
        )

    def names(self) -> list[str]:
        with contextlib.suppress(AttributeError):
            self._fs.invalidate_cache(self._root)
        try:
            found = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return []
        return [
            entry["name"].rstrip("/").rsplit("/", 1)[-1]
            for entry in found
            if entry.get("type") == "file"
        ]


class ObjectHousekeeping:
    """What is around a bucket's checkpoints: partial uploads, a process's
    local scratch directory."""

    def __init__(self, storage: ObjectStorage):
        self._storage = storage

    def scratch_dir(self, name: str) -> str:
        """A local directory for a process's throwaway saves: a bucket is
        no place for them. One level deep, so that removing it leaves
        nothing behind; the same path each time, so that a killed worker's
        is written over by its restart."""
        digest = self._storage.digest_name
        return os.path.join(tempfile.gettempdir(), f"keras-ft-{digest}-{name}")

    def usage(self, path: str) -> int:
        return int(self._storage.fs.du(path.split("://", 1)[-1]))

    def leftovers(self) -> list[str]:
        """Checkpoint prefixes without a manifest: partial uploads."""
        return [
            self._storage._path(sequence)
            for sequence, names in sorted(self._storage._listing().items())
            if MANIFEST_FILE not in names
        ]

    def foreign(self) -> list[str]:
        """Nothing: an object store has no links."""
        return []

    def remove_leftovers(self) -> None:
        for sequence, names in self._storage._listing().items():
            if MANIFEST_FILE not in names:
                self._storage._remove(
                    Checkpoint(sequence, self._storage._path(sequence)), True
                )

    def remove_root(self) -> None:
        """Nothing to do: a prefix is gone with its last object."""

    def discard(self, beside: str) -> bool:
        """A bucket's objects are deleted where they are (`delete()`)."""
        return False


class RemoteParts:
    """The parts of a sharded save uploaded into the bucket checkpoint
    numbered `sequence` (`keras_ft/checkpoint/parts.py`'s protocol). Until
    the chief's manifest, the checkpoint is a partial upload: never read,
    removed by the next writer."""

    poll_seconds = 0.25

    def __init__(self, storage: ObjectStorage, sequence: int):
        self._storage, self._sequence = storage, sequence
        self._checkpoint = Checkpoint(sequence, storage._path(sequence))
        self.where = storage.url(Checkpoint(sequence, ""))

    def write_data(
        self,
        name: str,
        chunks: list[Any],
        cancel: threading.Event | None,
        hasher: threads.Pool | None = None,
    ) -> dict[str, Any]:
        # Staged on local disk, as every upload is: written with direct I/O
        # from the share's buffer, the upload streams it with retries.
        staged = scratch.make("part")
        try:
            path = os.path.join(staged, name)
            entry = file_io.write_file(
                path, chunks, sync=False, cancel=cancel, hasher=hasher
            )
            self._upload(name, path, cancel)
        finally:
            scratch.remove(staged)
        return entry

    def write_index(self, name: str, data: bytes) -> None:
        staged = scratch.make("part")
        try:
            path = os.path.join(staged, name)
            with open(path, "wb") as f:
                f.write(data)
            self._upload(name, path, None)
        finally:
            scratch.remove(staged)

    def _upload(self, name: str, path: str, cancel: threading.Event | None) -> None:
        key = self._storage._key(self._checkpoint, name)
        self._storage._upload(path, key, cancel)

    def read_index(self, name: str, limit: int) -> bytes | None:
        """A part's index, committed or not; `None` if it is not there (yet)."""
        fs, key = self._storage.fs, self._storage._key(self._checkpoint, name)
        # A listing cached before the upload would say it is not there.
        with contextlib.suppress(AttributeError):
            fs.invalidate_cache(key)

        def read() -> bytes:
            with fs.open(key, "rb") as f:
                return f.read(limit + 1)

        try:
            data = transfers.as_os_error(read, f"download of {key}")
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{key} is larger than {limit} bytes")
        return data

    def adopt(self, staging: Staging, name: str, entry: dict[str, Any]) -> None:
        staging.sequence = self._sequence
        staging.in_place[name] = {**entry, PIECEWISE: True}

    def adopt_index(self, staging: Staging, name: str, data: bytes) -> None:
        digest = file_io.DIGESTS[file_io.DIGEST]()
        digest.update(data)
        staging.in_place[name] = {"size": len(data), file_io.DIGEST: digest.hexdigest()}

    def remove_earlier(self) -> None:
        """Nothing: earlier saves' partial uploads are the next writer's
        leftovers (`remove_leftovers()`)."""

    def discard(self) -> None:
        """Removes what was uploaded if it has no manifest (a save that
        failed before its commit)."""
        storage = self._storage
        with contextlib.suppress(Exception):  # Else the next writer does.
            if MANIFEST_FILE not in storage._listing().get(self._sequence, set()):
                storage._remove(self._checkpoint, True)

    def close(self) -> None:
        """Nothing: the parts are the checkpoint's own files."""
