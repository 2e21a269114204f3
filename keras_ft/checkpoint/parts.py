"""Where the processes' parts of one sharded save wait for the chief's commit.

A model split across processes is saved by every process writing its part
(its pieces' file, then their index, last) and the chief committing them
all as one checkpoint. Where parts wait is the storage's business; the save
(`distribute/sharded.py`) only speaks this protocol, the same on a disk
and in a bucket:

- `write_data(name, chunks, cancel)`: a part's file, durable once this
  returns; its manifest entry (size, checksum).
- `write_index(name, data)`: a part's index, all or nothing: a reader sees
  it whole or not at all (it says the part is done).
- `read_index(name, limit)`: an index, or `None` if it is not there yet.
- `adopt(staging, name, entry)`, `adopt_index(staging, name, data)`: make
  a part's file (and index) files of the checkpoint `staging` becomes.
- `remove_earlier()`: parts of saves before this one (called off or
  killed); `discard()`: this save's parts, after a failure; `close()`: what
  is left once the commit took what it needed.

On a disk (`LocalParts`) the parts wait in `chief/.parts-<tag>/`, a directory
every process shares, and move into the staging directory by rename. In a
bucket (`remote.RemoteParts`) they are uploaded straight into the
checkpoint's own prefix, which the chief's manifest then commits in place.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from keras_ft import threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import PIECEWISE

# The prefix of a sharded save's parts directory beside the checkpoints.
PARTS_PREFIX = ".parts-"


class Parts(Protocol):
    """The parts of one sharded save (see the module's docstring)."""

    # Names where the parts are, in messages.
    where: str
    # How long to wait, at most, between two looks for an index (a bucket is
    # polled more gently than a disk).
    poll_seconds: float

    def write_data(
        self,
        name: str,
        chunks: Sequence[Any],
        cancel: threading.Event | None,
        hasher: threads.Pool | None = None,
    ) -> dict[str, Any]: ...

    def write_index(self, name: str, data: bytes) -> None: ...

    def read_index(self, name: str, limit: int) -> bytes | None: ...

    def adopt(self, staging: Staging, name: str, entry: dict[str, Any]) -> None: ...

    def adopt_index(self, staging: Staging, name: str, data: bytes) -> None: ...

    def remove_earlier(self) -> None: ...

    def discard(self) -> None: ...

    def close(self) -> None: ...


class LocalParts:
    """The parts of the save `tag` in `chief_dir/.parts-<tag>/`."""

    poll_seconds = 0.05

    def __init__(self, chief_dir: str, tag: str):
        self._root, self._tag = chief_dir, tag
        self.where = os.path.join(chief_dir, f"{PARTS_PREFIX}{tag}")

    def write_data(
        self,
        name: str,
        chunks: Sequence[Any],
        cancel: threading.Event | None,
        hasher: threads.Pool | None = None,
    ) -> dict[str, Any]:
        os.makedirs(self.where, exist_ok=True)
        return file_io.write_file(
            os.path.join(self.where, name), chunks, cancel=cancel, hasher=hasher
        )

    def write_index(self, name: str, data: bytes) -> None:
        os.makedirs(self.where, exist_ok=True)
        temporary = os.path.join(self.where, f".{name}")
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temporary, os.path.join(self.where, name))

    def read_index(self, name: str, limit: int) -> bytes | None:
        try:
            with open(os.path.join(self.where, name), "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None

    def adopt(self, staging: Staging, name: str, entry: dict[str, Any]) -> None:
        os.rename(os.path.join(self.where, name), os.path.join(staging, name))
        staging.digests[name] = {**entry, PIECEWISE: True}
        staging.synced.add(name)  # Its process fsync'ed it before its index.

    def adopt_index(self, staging: Staging, name: str, data: bytes) -> None:
        """Nothing: on a disk the indexes stay out of the checkpoint (its
        table, `shards.json`, lists every piece)."""

    def remove_earlier(self) -> None:
        remove_local_parts(self._root, before=self._tag)

    def discard(self) -> None:
        shutil.rmtree(self.where, ignore_errors=True)

    def close(self) -> None:
        """The parts directory goes in any case: what the checkpoint needed
        was moved out of it, and what a failed save wrote is never
        committed."""
        shutil.rmtree(self.where, ignore_errors=True)


def remove_local_parts(chief_dir: str, before: str | None = None) -> None:
    """Removes parts directories: all, or those of saves older than `before`."""
    try:
        names = os.listdir(chief_dir)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(PARTS_PREFIX) and (
            before is None or name[len(PARTS_PREFIX) :] < before
        ):
            shutil.rmtree(os.path.join(chief_dir, name), ignore_errors=True)
