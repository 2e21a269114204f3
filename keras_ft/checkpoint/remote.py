"""Checkpoints in object storage (S3, GCS, ...), through fsspec.

An object store has no atomic rename of a directory, so the commit is another
one: a checkpoint's files are uploaded first, under `<prefix>/ckpt-<n>/`, and
its manifest (the size and checksum of every file) last, as one object. A
reader trusts only a checkpoint whose manifest exists and verifies, and
verifies each file against it; a checkpoint directory without a manifest is a
partial upload (a writer killed mid-upload), never read, removed by the next
writer. Old checkpoints are deleted only after a newer one is committed,
manifest first, so that a half-deleted one is never taken for a good one.

The files themselves are made by the local store's protocol (`store.py`),
in a local staging directory: the same bytes, the same manifest. A restore
downloads a checkpoint into a local directory, verifies it there and loads it
like a local one, so a resume on a new machine needs nothing but the bucket.

One writer per prefix: there is no `flock` on a bucket, so the writer holds a
lease, an object `.lease.json` with its host, pid and a heartbeat it renews
every few seconds. Another writer may take it over only when the heartbeat
is older than `KERAS_FT_LEASE_SECONDS` (default 30), or when the holder is a
process on the same host that no longer runs.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from keras_ft import threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.errors import CorruptCheckpointError, SaveCancelled
from keras_ft.checkpoint.lock import DirectoryInUseError
from keras_ft.checkpoint.store import (
    MANIFEST_FILE,
    MAX_NOTICE_BYTES,
    METADATA_FILE,
    Checkpoint,
    CheckpointStore,
    NoGoodCheckpointError,
    ReadProgress,
    RetentionPolicy,
    Staging,
    check_notice_name,
    checkpoint_name,
    checkpoint_sequence,
    digest_algorithm,
    manifest_files,
)

_T = TypeVar("_T")
LEASE_FILE = ".lease.json"
LEASE_SECONDS_ENV = "KERAS_FT_LEASE_SECONDS"
_RETRIES = 4  # Attempts of each upload or download, with backoff between.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def is_url(path: str) -> bool:
    """Whether `path` names object storage (`s3://`, `memory://`, ...), not a
    local path. `file://` URLs are local paths."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme != "file" and re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme)


def local_path(path: str) -> str:
    """`path` without a `file://` scheme."""
    return path[len("file://") :] if path.startswith("file://") else path


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


class RemoteCheckpointStore:
    """`CheckpointStore` over an fsspec filesystem; the manifest is the commit.

    Args:
        url: Where committed checkpoints live (`s3://bucket/run/chief`).
        retention: What to keep after each commit, or `None` for everything.
        storage_options: Passed to fsspec. Defaults to `None`.
        progress: If set, called with a line of text at each quarter of an
            upload of at least `progress_bytes`. Defaults to `None`.
        progress_bytes: Uploads this large or larger report progress.
            Defaults to 256 MiB.
    """

    def __init__(
        self,
        url: str,
        retention: RetentionPolicy | None = None,
        storage_options: dict | None = None,
        progress: Callable[[str], None] | None = None,
        progress_bytes: int = 256 << 20,
    ):
        self.directory = url.rstrip("/")
        self.retention = retention
        self.fs, self.root = filesystem(self.directory, storage_options)
        self.root = self.root.rstrip("/")
        self._local: str | None = None  # Staging and downloads, this process.
        self.progress = progress
        self.progress_bytes = progress_bytes

    write_error_fix = "Check that the bucket is reachable and the credentials valid"

    def __repr__(self) -> str:
        return f"RemoteCheckpointStore({self.directory!r})"

    @property
    def identity(self) -> str:
        return self.directory

    def writer_lock(self) -> RemoteLease:
        """The lock one writer holds: a lease object with a heartbeat."""
        return RemoteLease(self)

    def url(self, checkpoint: Checkpoint) -> str:
        """Where `checkpoint` is in the bucket (its downloaded copy's too)."""
        return self._path(checkpoint.sequence)

    # Reading.

    def _listing(self) -> dict[int, set[str]]:
        """`{sequence: names of the files}` of every checkpoint directory."""
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

    def leftovers(self) -> list[str]:
        """Checkpoint directories without a manifest: partial uploads."""
        return [
            self._path(sequence)
            for sequence, names in sorted(self._listing().items())
            if MANIFEST_FILE not in names
        ]

    def _path(self, sequence: int) -> str:
        return f"{self.directory}/{checkpoint_name(sequence)}"

    def _key(self, checkpoint: Checkpoint, name: str = "") -> str:
        key = f"{self.root}/{checkpoint_name(checkpoint.sequence)}"
        return f"{key}/{name}" if name else key

    def verify(
        self, checkpoint: Checkpoint, progress: ReadProgress | None = None
    ) -> dict[str, Any]:
        """Checks every object of `checkpoint` against its manifest, streaming.

        Returns:
            The checkpoint's metadata.

        Raises:
            CorruptCheckpointError: naming what is wrong.
        """
        manifest = self._read_json(checkpoint, MANIFEST_FILE)
        for name, expected in manifest_files(manifest, checkpoint.path).items():
            key = self._key(checkpoint, name)
            try:
                size = self.fs.size(key)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    checkpoint.path, f"{name} is missing"
                ) from None
            if size != expected["size"]:
                raise CorruptCheckpointError(
                    checkpoint.path,
                    f"{name} has {size} bytes, the manifest says "
                    f"{expected['size']} (truncated or overwritten)",
                )
            algorithm = digest_algorithm(expected)
            digest = file_io.DIGESTS[algorithm]()
            with self.fs.open(key, "rb", block_size=8 << 20) as f:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != expected[algorithm]:
                raise CorruptCheckpointError(
                    checkpoint.path,
                    f"{name} does not match its "
                    f"{file_io.DIGEST_NAMES[algorithm]} checksum",
                )
        metadata = self._read_json(checkpoint, METADATA_FILE)
        if not isinstance(metadata, dict):
            raise CorruptCheckpointError(checkpoint.path, "metadata is not an object")
        return metadata

    def _read_json(self, checkpoint: Checkpoint, name: str) -> Any:
        try:
            with self.fs.open(self._key(checkpoint, name), "rb") as f:
                return json.loads(f.read(64 << 20))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                checkpoint.path, f"{name} is missing"
            ) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(
                checkpoint.path, f"{name} is not valid JSON ({e})"
            ) from None

    def latest_good(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """The newest checkpoint that verifies, and its metadata (its
        download removed)."""
        found = self.latest_good_read(lambda checkpoint, progress: None)
        if found is None:
            return None
        self.release(found[0])
        return Checkpoint(found[0].sequence, self.url(found[0])), found[1]

    def latest_good_read(
        self, read: Callable[[Checkpoint, ReadProgress], _T]
    ) -> tuple[Checkpoint, dict[str, Any], _T] | None:
        """The newest checkpoint that verifies, downloaded and read locally.

        As `CheckpointStore.latest_good_read()`, but the checkpoint returned
        is the local copy (its `path` a local directory); `url()` says where
        it came from.
        """
        candidates = self.checkpoints()
        problems = []
        for checkpoint in reversed(candidates):
            try:
                return self._download_read(checkpoint, read)
            except CorruptCheckpointError as e:
                problems.append(str(e))
                warnings.warn(
                    f"{e}. Falling back to the previous checkpoint.", stacklevel=2
                )
        if candidates:
            raise NoGoodCheckpointError(
                f"None of the {len(candidates)} checkpoints in {self.directory} "
                "can be restored; nothing was deleted. Problems found:\n  "
                + "\n  ".join(problems)
                + "\nRemove the prefix to start training from scratch."
            )
        return None

    def fetch(
        self, checkpoint: Checkpoint, read: Callable[[Checkpoint, ReadProgress], _T]
    ) -> tuple[Checkpoint, dict[str, Any], _T]:
        """`read()`, with the verified local copy to load from; `release()`
        it once loaded."""
        return self._download_read(checkpoint, read)

    def release(self, checkpoint: Checkpoint) -> None:
        """Removes the local copy of a checkpoint that `fetch()` or
        `latest_good_read()` returned, once it is loaded. Arrays a loader
        mapped from it stay valid: an unlinked file lives on while mapped."""
        root = os.path.dirname(checkpoint.path)
        if self._local is not None and os.path.dirname(root) == self._local:
            shutil.rmtree(root, ignore_errors=True)

    def _download_read(
        self, checkpoint: Checkpoint, read: Callable[[Checkpoint, ReadProgress], _T]
    ) -> tuple[Checkpoint, dict[str, Any], _T]:
        local_root = os.path.join(self._local_dir(), f"download-{secrets.token_hex(4)}")
        local = Checkpoint(
            checkpoint.sequence,
            os.path.join(local_root, checkpoint_name(checkpoint.sequence)),
        )
        os.makedirs(local.path)
        try:
            return self._download_read_into(checkpoint, local, read)
        except BaseException:
            shutil.rmtree(local_root, ignore_errors=True)
            raise

    def _download_read_into(
        self,
        checkpoint: Checkpoint,
        local: Checkpoint,
        read: Callable[[Checkpoint, ReadProgress], _T],
    ) -> tuple[Checkpoint, dict[str, Any], _T]:
        try:
            self.fs.get_file(
                self._key(checkpoint, MANIFEST_FILE), local.file(MANIFEST_FILE)
            )
        except FileNotFoundError:
            raise CorruptCheckpointError(
                checkpoint.path, "manifest is missing (deleted?)"
            ) from None
        with open(local.file(MANIFEST_FILE), "rb") as f:
            try:
                manifest = json.loads(f.read(64 << 20))
            except ValueError as e:
                raise CorruptCheckpointError(
                    checkpoint.path, f"manifest is not valid JSON ({e})"
                ) from None
        names = list(manifest_files(manifest, checkpoint.path))
        downloads = [
            threads.submit(
                threads.transfer, self._download, checkpoint, name, local.file(name)
            )
            for name in names
        ]
        for download in downloads:
            download.result()
        metadata, result = CheckpointStore(os.path.dirname(local.path)).read(
            local, read
        )
        return local, metadata, result

    def _download(self, checkpoint: Checkpoint, name: str, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # Verification says so.
            _retried(lambda: self.fs.get_file(self._key(checkpoint, name), path))

    def _local_dir(self) -> str:
        if self._local is None:
            self._local = tempfile.mkdtemp(prefix="keras-ft-remote-")
            atexit.register(shutil.rmtree, self._local, ignore_errors=True)
        return self._local

    # Writing.

    def save(
        self,
        write_files: Callable[[Staging], None],
        metadata: dict[str, Any],
        cancel: threading.Event | None = None,
        after: Callable[[], None] | None = None,
        supersedes: Callable[[], Checkpoint | None] | None = None,
    ) -> Checkpoint:
        """Writes a checkpoint locally, uploads it, then commits its manifest.

        See `CheckpointStore.save()`. An upload that fails after retries is
        an `OSError`; what was uploaded of it is removed.
        """
        staging_root = os.path.join(self._local_dir(), f"up-{secrets.token_hex(4)}")
        local = CheckpointStore(staging_root).save(write_files, metadata, cancel, after)
        try:
            if cancel is not None and cancel.is_set():
                raise SaveCancelled()
            listing = _as_os_error(self._listing, f"listing {self.directory}")
            sequence = max(listing, default=0) + 1
            committed = Checkpoint(sequence, self._path(sequence))
            names = [n for n in sorted(os.listdir(local.path)) if n != MANIFEST_FILE]
            try:
                uploads = [
                    threads.submit(
                        threads.transfer, self._upload, local.file(n),
                        self._key(committed, n), cancel,
                    )
                    for n in names
                ]  # fmt: skip
                for upload in uploads:
                    upload.result()
                if cancel is not None and cancel.is_set():
                    raise SaveCancelled()
                # The commit: one object, written last.
                self._upload(
                    local.file(MANIFEST_FILE), self._key(committed, MANIFEST_FILE)
                )
            except BaseException:
                self._remove(committed, ignore_errors=True)
                raise
        finally:
            shutil.rmtree(staging_root, ignore_errors=True)
        try:  # Committed: a failed clean-up is retried after the next commit.
            replaced = supersedes() if supersedes is not None else None
            if replaced is not None:
                self.delete(replaced)
            self.prune()
        except Exception as e:  # Any backend's error.
            warnings.warn(
                f"keras-ft: {committed.path} is committed, but deleting older "
                f"checkpoints failed ({type(e).__name__}: {e}); retried later.",
                stacklevel=2,
            )
        return committed

    def _upload(
        self, path: str, key: str, cancel: threading.Event | None = None
    ) -> None:
        if cancel is not None and cancel.is_set():
            raise SaveCancelled()
        size = os.path.getsize(path)
        report = self.progress is not None and size >= self.progress_bytes

        def put() -> None:
            if report:
                self.fs.put_file(
                    path, key, callback=_progress(key, size, self.progress)
                )
            else:
                self.fs.put_file(path, key)

        _as_os_error(put, f"upload of {key}")

    def prune(self) -> None:
        """Deletes the checkpoints that the retention policy lets go."""
        if self.retention is None:
            return
        committed = self.checkpoints()
        for checkpoint in self.retention.select_for_deletion(committed):
            if checkpoint != committed[-1]:
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

    def remove_leftovers(self) -> None:
        """Removes partial uploads (checkpoint directories without manifest)."""
        for sequence, names in self._listing().items():
            if MANIFEST_FILE not in names:
                self._remove(Checkpoint(sequence, self._path(sequence)), True)

    def clear(self) -> None:
        """Deletes every checkpoint and leftover this store made."""
        for checkpoint in self.checkpoints():
            self.delete(checkpoint)
        self.remove_leftovers()

    # Notices, as `CheckpointStore`'s: objects beside the checkpoints.

    def create_notice(self, name: str, data: bytes) -> bool:
        """Writes the notice `name` unless one exists: the first writer wins
        where the store has a conditional create (S3's `If-None-Match`, what
        fsspec's `mode="create"` asks for); elsewhere fsspec checks, then
        writes, and two writers within one round trip may both write."""
        check_notice_name(name)
        key = f"{self.root}/{name}"
        for attempt in range(_RETRIES):
            try:
                self.fs.pipe_file(key, data, mode="create")
                return True
            except FileExistsError:
                return False
            except Exception as e:  # Network and service errors differ.
                if _precondition_failed(e):
                    return False
                if attempt == _RETRIES - 1:
                    raise
                time.sleep(0.25 * 2**attempt)
        raise AssertionError("unreachable")

    def read_notice(self, name: str) -> bytes | None:
        check_notice_name(name)
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self.root)
        try:
            with self.fs.open(f"{self.root}/{name}", "rb") as f:
                return f.read(MAX_NOTICE_BYTES)
        except FileNotFoundError:
            return None

    def remove_notice(self, name: str) -> None:
        check_notice_name(name)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.root}/{name}")

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
                f"{self.directory!r} ({type(e).__name__}: {e}). Check the bucket "
                "exists and the credentials (fsspec's configuration, or "
                "`storage_options=`)."
            ) from e


def _progress(key: str, size: int, say: Callable[[str], None]) -> Any:
    """An fsspec callback that reports each quarter of an upload."""
    from fsspec.callbacks import Callback

    started = time.monotonic()
    name = "/".join(key.rsplit("/", 2)[-2:])

    class Quarters(Callback):
        reported = 0

        def call(self, *args: Any, **kwargs: Any) -> None:
            quarter = min(4, (self.value or 0) * 4 // max(size, 1))
            if quarter > self.reported:
                self.reported = quarter
                say(
                    f"keras-ft: uploading {name}: {quarter * 25}% of "
                    f"{size / 2**20:.0f} MB ({time.monotonic() - started:.1f} s)"
                )

    return Quarters(size=size)


def open_store(
    path: str,
    retention: RetentionPolicy | None = None,
    storage_options: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> CheckpointStore | RemoteCheckpointStore:
    """The store of checkpoints at `path`: a local directory or a URL
    (`storage_options` and upload `progress` apply to a URL's)."""
    if is_url(path):
        return RemoteCheckpointStore(path, retention, storage_options, progress)
    return CheckpointStore(local_path(path), retention)


def checkpoints_dir(path: str) -> str:
    """A backup directory's checkpoints: in `chief/`, or in `path` itself."""
    if is_url(path):
        return f"{path.rstrip('/')}/chief"
    path = local_path(path)
    chief = os.path.join(path, "chief")
    return chief if os.path.isdir(chief) or not os.path.isdir(path) else path


class RemoteLease:
    """One writer per prefix of a bucket: a lease object with a heartbeat.

    Args:
        store: The store whose prefix to hold.
        seconds: How old a heartbeat must be before another writer may take
            the lease over. Defaults to `KERAS_FT_LEASE_SECONDS` or 30.
    """

    def __init__(self, store: RemoteCheckpointStore, seconds: float | None = None):
        self.fs = store.fs
        self.directory = store.directory
        self.key = f"{store.root}/{LEASE_FILE}"
        self.seconds = (
            seconds
            if seconds is not None
            else float(os.environ.get(LEASE_SECONDS_ENV, "30"))
        )
        self._token: str | None = None
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            with self.fs.open(self.key, "rb") as f:
                value = json.loads(f.read(1 << 16))
        except (FileNotFoundError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _write(self) -> None:
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self._token,
            "heartbeat": time.time(),
        }
        self.fs.pipe_file(self.key, json.dumps(holder).encode())

    def acquire(self) -> None:
        """Takes the lease, or raises `DirectoryInUseError` naming its holder."""
        if self._token is not None:
            return
        held = self._read()
        if held is not None and not self._expired(held):
            raise self._in_use(held)
        self._token = secrets.token_hex(8)
        self._write()
        # Two writers that both found it free: the last write wins; the
        # other sees a token not its own and backs off.
        time.sleep(0.2)
        held = self._read()
        if held is None or held.get("token") != self._token:
            self._token = None
            raise self._in_use(held or {})
        self._stop.clear()
        self._beating = threads.start_daemon(self._heartbeat, "keras-ft-lease")

    def _heartbeat(self) -> None:
        while not self._stop.wait(max(self.seconds / 3, 0.5)):
            with contextlib.suppress(Exception):  # Retried at the next beat.
                if self._token is not None:
                    self._write()

    def release(self, remove: bool = False) -> None:
        """Gives the lease back: its object is removed if it is still ours."""
        self._stop.set()
        beating, self._beating = self._beating, None
        if beating is not None and beating is not threading.current_thread():
            beating.join(timeout=30)  # At most one write of the lease.
        token, self._token = self._token, None
        if token is None:
            return
        try:
            held = self._read()
            if held is not None and held.get("token") == token:
                self.fs.rm_file(self.key)
        except Exception:  # Out of reach: the lease expires on its own.
            pass

    def _expired(self, held: dict) -> bool:
        age = time.time() - float(held.get("heartbeat", 0))
        if age > self.seconds:
            return True
        if held.get("host") == socket.gethostname():
            pid = held.get("pid")
            if pid == os.getpid():
                return True  # A lease of an earlier fit() in this process.
            try:
                os.kill(int(pid), 0)
            except (ProcessLookupError, ValueError, TypeError):
                return True  # That process is gone.
            except PermissionError:
                return False
        return False

    def _in_use(self, held: dict) -> DirectoryInUseError:
        age = time.time() - float(held.get("heartbeat", 0))
        return DirectoryInUseError(
            f"{self.directory} is in use by another training (pid "
            f"{held.get('pid')} on {held.get('host')}, heartbeat {age:.0f} s ago): "
            "one writer per backup. Stop it, or use another backup_dir; a lease "
            f"whose heartbeat is older than {self.seconds:g} s "
            f"({LEASE_SECONDS_ENV}) is taken over."
        )


def _precondition_failed(error: Exception) -> bool:
    """Whether a conditional write was refused because the object exists
    (S3 answers 412 Precondition Failed; clients raise their own types)."""
    text = f"{type(error).__name__} {error}"
    return "PreconditionFailed" in text or "412" in text


def _as_os_error(action: Callable[[], _T], what: str) -> _T:
    """`action()`, retried; a failure is an `OSError`, as a disk's would be."""
    try:
        return _retried(action)
    except FileNotFoundError:
        raise
    except Exception as e:  # Any backend's error is a failed write.
        raise OSError(
            getattr(e, "errno", None) or errno.EIO,
            f"{what} failed after {_RETRIES} attempts ({type(e).__name__}: {e})",
        ) from e


def _retried(action: Callable[[], _T]) -> _T:
    """`action()`, tried again with backoff on an error (not a missing file)."""
    for attempt in range(_RETRIES):
        try:
            return action()
        except FileNotFoundError:
            raise
        except Exception:  # Network and service errors differ by backend.
            if attempt == _RETRIES - 1:
                raise
            time.sleep(0.25 * 2**attempt)
    raise AssertionError("unreachable")
