"""What a checkpoint is on any storage: its name, its files, its manifest.

Shared by the storage protocol (`store.py`) and its two storages
(`local.py`, `remote.py`); nothing here touches a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from keras_ft.checkpoint import files as file_io
from keras_ft.errors import CorruptCheckpointError

MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.json"
# A manifest entry's mark: the file's reader checks each piece it reads
# (sharded checkpoints), so a restore checks only its size.
PIECEWISE = "piecewise"
FORMAT_NAME = "keras-ft-checkpoint"
FORMAT_VERSION = 1
# A manifest or metadata file larger than this is not one keras-ft wrote.
MAX_JSON_BYTES = 64 * 1024 * 1024
# Notices are small JSON files with plain names, never a checkpoint's.
MAX_NOTICE_BYTES = 64 * 1024
# The secret manifests are signed with, where no argument gives one.
MANIFEST_KEY_ENV = "KERAS_FT_MANIFEST_KEY"

# ASCII digits only, and few enough: a name from a backup is untrusted.
_CHECKPOINT_NAME = re.compile(r"ckpt-([0-9]{8,18})", re.ASCII)
_NOTICE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\.json")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint.

    Where it was read (`watch()`, `load_checkpoint()`), it also says what it
    holds: `epoch`, `batch`, `step` and `saved_at`; elsewhere (a listener's,
    a store's listing) they are `None`. Two checkpoints are equal when their
    `sequence` and `path` are.

    Attributes:
        sequence: The checkpoint's number; a newer checkpoint has a larger one.
        path: The checkpoint's directory (or prefix, in object storage).
        ranges: For a local copy of a bucket's checkpoint that left some
            files in the bucket (`CheckpointReader.local_copy(ranged=...)`), how to
            read byte ranges of them: `ranges(name, offset, size) -> bytes`;
            else `None`.
        epoch: Epochs completed at the save (where a resume starts).
        batch: Batches of the next epoch trained at the save.
        step: The optimizer's `iterations` at the save.
        saved_at: When it was saved, in seconds since the epoch.
    """

    sequence: int
    path: str
    ranges: Callable[[str, int, int], bytes] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    epoch: int | None = dataclasses.field(default=None, compare=False)
    batch: int | None = dataclasses.field(default=None, compare=False)
    step: int | None = dataclasses.field(default=None, compare=False)
    saved_at: float | None = dataclasses.field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def file(self, name: str) -> str:
        """Returns the path of the file `name` inside this checkpoint."""
        return f"{self.path.rstrip('/')}/{name}"


@dataclasses.dataclass(frozen=True)
class CommitTurn:
    """What a commit does around taking its number.

    A storage calls `take()` once a checkpoint's files are durable (or, in
    a bucket, before they are uploaded), before it numbers the checkpoint:
    it checks the writer's `lock` (a lapsed lease: another writer may
    commit). It calls `numbered(checkpoint)` right
    before the commit point, which tells `committing(checkpoint,
    metadata)`: a note of what is being committed, written there, is never
    later than the commit.
    """

    lock: Any = None  # A `DirectoryLock` or a lease: anything with `check()`.
    committing: Callable[[Checkpoint, dict], None] | None = None
    metadata: dict = dataclasses.field(default_factory=dict)

    def take(self) -> None:
        if self.lock is not None:
            self.lock.check()

    def numbered(self, checkpoint: Checkpoint) -> None:
        if self.committing is not None:
            self.committing(checkpoint, self.metadata)


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


def join_location(location: str, *names: str) -> str:
    """`names` below `location`: a bucket's URL or a local directory."""
    if is_url(location):
        return "/".join([location.rstrip("/"), *names])
    return os.path.join(location, *names)


def is_url(path: str) -> bool:
    """Whether `path` names object storage (`s3://`, `memory://`, ...), not a
    local path. `file://` URLs are local paths."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme != "file" and re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme)


# The chief's checkpoints, in `backup_dir`: the one place that names it.
CHIEF_DIR = "chief"


def chief_directory(backup_dir: str) -> str:
    """Where the chief commits the checkpoints of `backup_dir` (a directory
    or a URL)."""
    if is_url(backup_dir):
        return f"{backup_dir.rstrip('/')}/{CHIEF_DIR}"
    return os.path.join(local_path(backup_dir), CHIEF_DIR)


def local_path(path: str) -> str:
    """`path` without a `file://` scheme."""
    return path[len("file://") :] if path.startswith("file://") else path


def is_notice_name(name: str) -> bool:
    return _NOTICE_NAME.fullmatch(name) is not None


def check_notice_name(name: str) -> None:
    if not is_notice_name(name):
        raise ValueError(f"Not a notice name: {name!r}.")


def signing_key(
    key: str | bytes | None, argument: str = "manifest_key"
) -> bytes | None:
    """The HMAC key manifests are signed and checked with: `key`, else the
    environment's `KERAS_FT_MANIFEST_KEY`, else `None` (no signatures).

    Raises:
        ValueError: for an empty key or one of another type, naming `argument`.
    """
    if key is None:
        key = os.environ.get(MANIFEST_KEY_ENV) or None
        argument = MANIFEST_KEY_ENV
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes) or not key:
        raise ValueError(
            f"Invalid value for argument `{argument}`. Expected a non-empty "
            f"string or bytes, the secret that signs every manifest. Received: "
            f"{argument}={key!r}"
        )
    return key


def manifest_body(
    files: dict[str, dict[str, Any]], created_at: float, key: bytes | None = None
) -> dict:
    """A manifest listing `files`, with the digest that seals it, and with a
    `key`, its HMAC-SHA256 signature."""
    body = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_at": created_at,
        "files": files,
    }
    sealed = {**body, "digest": _json_digest(body)}
    if key is not None:
        sealed["signature"] = _signature(key, sealed)
    return sealed


def manifest_files(
    manifest: Any, where: str, key: bytes | None = None
) -> dict[str, dict[str, Any]]:
    """A manifest's `{file name: {"size": ..., algorithm: digest}}`, checked;
    with a `key`, only if its signature is that key's.

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
    body = {k: v for k, v in manifest.items() if k not in ("digest", "signature")}
    if manifest.get("digest") != _json_digest(body):
        raise CorruptCheckpointError(where, "manifest digest mismatch")
    if key is not None:
        _check_signature(manifest, where, key)
    files = manifest.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files:
        raise CorruptCheckpointError(where, "manifest lists no files")
    for name, expected in files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..", MANIFEST_FILE)
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
            or isinstance(expected.get("size"), bool)
            or expected["size"] < 0
            or not isinstance(expected.get(algorithm), str)
        ):
            raise CorruptCheckpointError(
                where, f"manifest entry for {name} is malformed"
            )
    # Refused before anything is downloaded or checksummed: no metadata that
    # large was ever written, and it would be refused once read anyway.
    if files[METADATA_FILE]["size"] > MAX_JSON_BYTES:
        raise CorruptCheckpointError(
            where,
            f"manifest lists {METADATA_FILE} at {files[METADATA_FILE]['size']} "
            f"bytes, more than the {MAX_JSON_BYTES} keras-ft reads",
        )
    return files


def _check_signature(manifest: dict, where: str, key: bytes) -> None:
    signature = manifest.get("signature")
    sealed = {k: v for k, v in manifest.items() if k != "signature"}
    if not isinstance(signature, str):
        raise CorruptCheckpointError(
            where,
            "manifest is not signed, and a manifest key is set: refused "
            "(written by a training without the key, or by someone else)",
        )
    if not hmac.compare_digest(signature, _signature(key, sealed)):
        raise CorruptCheckpointError(
            where,
            "manifest signature does not match the manifest key: refused "
            "(signed with another key, or altered)",
        )


def digest_algorithm(entry: Any) -> str | None:
    """The checksum algorithm of a manifest entry, if one keras-ft knows."""
    if not isinstance(entry, dict):
        return None
    return next((a for a in file_io.DIGESTS if a in entry), None)


def parse_json(data: bytes, where: str, name: str) -> Any:
    """`data` as JSON, or `CorruptCheckpointError` saying why not."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(
            where, f"{name} is not valid JSON ({type(e).__name__}: {e})"
        ) from None


def json_bytes(obj: Any, indent: int | None = None) -> bytes:
    # Without indentation json uses its C encoder: metadata with a model's
    # variable list and random states encodes ~10x faster.
    return json.dumps(obj, sort_keys=True, indent=indent).encode("utf-8")


def _signature(key: bytes, sealed: dict) -> str:
    text = json.dumps(sealed, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def _json_digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def validate_local_dir(local_dir: object, backup_dir: str) -> str | None:
    """Returns `local_dir` as a path (or `None`), or raises a `ValueError`."""
    if local_dir is None:
        return None
    if not isinstance(local_dir, (str, os.PathLike)) or not os.fspath(local_dir):
        raise ValueError(
            "Invalid value for argument `local_dir`. Expected a path to a "
            f"directory on this machine, or None. Received: local_dir={local_dir!r}"
        )
    path = os.fsdecode(os.fspath(local_dir))
    if is_url(path):
        raise ValueError(
            "Invalid value for argument `local_dir`: it is a URL; the local tier "
            "is a directory on this machine's own disk. Received: "
            f"local_dir={path!r}"
        )
    if not is_url(backup_dir):
        raise ValueError(
            "Invalid value for argument `local_dir`: `backup_dir` is a directory "
            "already, and a local tier is for a bucket `backup_dir` (s3://, "
            "gs://...). Pass local_dir=None, or a bucket as backup_dir. Received: "
            f"local_dir={path!r}, backup_dir={backup_dir!r}"
        )
    path = local_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            "Invalid value for argument `local_dir`: it is an existing file, not "
            f"a directory. Received: local_dir={path!r}"
        )
    return path


# `s3:/bucket/run`: a URL after a path function collapsed its `//`.
_LOST_SLASH = re.compile(r"[a-z][a-z0-9+.-]*:/(?!/)")


def validate_backup_dir(backup_dir: object) -> str:
    """Returns `backup_dir` as a string, or raises a `ValueError` saying why not."""
    if not backup_dir:
        # Keras' own sentence first, so code matching its message still works.
        raise ValueError(
            "Empty `backup_dir` argument passed. Expected a non-empty path to a "
            f"directory. Received: backup_dir={backup_dir!r}"
        )
    if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
        raise ValueError(
            "Invalid value for argument `backup_dir`. Expected a non-empty path "
            f"to a directory. Received: backup_dir={backup_dir!r}"
        )
    path = os.fspath(backup_dir)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if is_url(path):
        return path.rstrip("/")  # Object storage: checked at train begin.
    if _LOST_SLASH.match(path):
        # What `os.path.join()` or `normpath()` make of a URL: as a local
        # path it would become a directory named after the scheme.
        scheme, _, rest = path.partition(":/")
        raise ValueError(
            "Invalid value for argument `backup_dir`: it looks like a URL that "
            f"lost a slash, which would be a local directory named {scheme + ':'!r}."
            f" Write it as {scheme}://{rest}, or as ./{path} for a local "
            f"directory. Received: backup_dir={path!r}"
        )
    path = local_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            "Invalid value for argument `backup_dir`: it is an existing file, not "
            "a directory. Pass a directory path (it is created if missing). "
            f"Received: backup_dir={path!r}"
        )
    return path
