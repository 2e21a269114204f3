"""How a checkpoint reaches disk, and how a reader knows it can trust one.

A checkpoint is a directory of files committed atomically: the files are
written into a staging directory, each one fsync'ed, a manifest with the size
and SHA-256 of every file is written last, and the staging directory is renamed
to its final name. The rename is the commit: a reader only ever looks at
directories with a final name, and still verifies every checksum before it uses
one, so a torn write, a flipped bit or a deleted file is caught and the next
older checkpoint is used instead.

This module knows nothing of Keras: it stores whatever files a writer puts into
the staging directory, plus a JSON metadata dictionary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.json"
FORMAT_NAME = "keras-ft-checkpoint"
FORMAT_VERSION = 1

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})$")
_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
_CHUNK = 4 * 1024 * 1024
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

    def verify(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """Checks every file of `checkpoint` against its manifest.

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
            _verify_file(checkpoint, name, expected)
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
        candidates = self.checkpoints()
        problems = []
        for checkpoint in reversed(candidates):
            try:
                return checkpoint, self.verify(checkpoint)
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
                + "\nMove the directory away to start training from scratch."
            )
        return None

    # Writing.

    def save(
        self, write_files: Callable[[str], None], metadata: dict[str, Any]
    ) -> Checkpoint:
        """Writes and atomically commits a new checkpoint.

        Args:
            write_files: Called with a staging directory; writes the
                checkpoint's files into it (plain files, no subdirectories).
            metadata: JSON-serialisable dictionary stored with the files.

        Returns:
            The committed checkpoint.
        """
        os.makedirs(self.directory, exist_ok=True)
        sequence = self._next_sequence()
        staging = os.path.join(
            self.directory,
            f"{_STAGING_PREFIX}{sequence:08d}-{os.getpid()}-{secrets.token_hex(4)}",
        )
        final = os.path.join(self.directory, checkpoint_name(sequence))
        os.mkdir(staging)
        try:
            write_files(staging)
            _write_json(os.path.join(staging, METADATA_FILE), metadata)
            files = {}
            for name in sorted(os.listdir(staging)):
                path = os.path.join(staging, name)
                if not os.path.isfile(path) or os.path.islink(path):
                    raise ValueError(
                        f"A checkpoint holds plain files only; {name!r} is not one."
                    )
                files[name] = _fsync_and_digest(path)
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
            _fsync_path(os.path.join(staging, MANIFEST_FILE))
            _fsync_path(staging)
            # The commit: rename() of a directory is atomic, and refuses to
            # replace a non-empty directory, so no committed checkpoint is
            # ever overwritten.
            os.rename(staging, final)
            _fsync_path(self.directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        committed = Checkpoint(sequence, final)
        self.prune()
        return committed

    def prune(self) -> None:
        """Deletes the checkpoints that the retention policy lets go."""
        if self.retention is None:
            return
        committed = self.checkpoints()
        newest = committed[-1] if committed else None
        for checkpoint in self.retention.select_for_deletion(committed):
            if checkpoint != newest:
                self._delete(checkpoint.path)

    def remove_leftovers(self) -> None:
        """Removes staging and trash directories that a killed writer left."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def clear(self) -> None:
        """Deletes every checkpoint and leftover this store made.

        Other files in the directory are left alone; the directory itself is
        removed only if that leaves it empty.
        """
        for checkpoint in self.checkpoints():
            self._delete(checkpoint.path)
        self.remove_leftovers()
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)

    def delete(self, checkpoint: Checkpoint) -> None:
        """Deletes one committed checkpoint."""
        self._delete(checkpoint.path)

    def _delete(self, path: str) -> None:
        # Rename first, so a kill during rmtree never leaves a half-deleted
        # directory under a committed name.
        trash = os.path.join(self.directory, f"{_TRASH_PREFIX}{secrets.token_hex(6)}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _next_sequence(self) -> int:
        committed = self.checkpoints()
        return committed[-1].sequence + 1 if committed else 1


def _json_digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, sort_keys=True, indent=1)


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


def _verify_file(checkpoint: Checkpoint, name: Any, expected: Any) -> None:
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
    if (
        not isinstance(expected, dict)
        or not isinstance(expected.get("size"), int)
        or not isinstance(expected.get("sha256"), str)
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
    if _fsync_and_digest(path, sync=False)["sha256"] != expected["sha256"]:
        raise CorruptCheckpointError(
            checkpoint.path, f"{name} does not match its SHA-256 checksum"
        )


def _fsync_and_digest(path: str, sync: bool = True) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
