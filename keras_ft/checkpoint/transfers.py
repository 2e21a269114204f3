"""Moving bytes to and from a bucket: retries, and downloads in ranges.

Every transfer is retried with backoff (a network blip is not a failed
save); a failure after the last attempt is an `OSError`, as a disk's would
be. A large object of a restore is downloaded in ranges on several
connections and written in place, so that its checksum (and the load)
follow it as it arrives; a local copy may also leave files in the bucket,
read later by ranges (the copy's `Checkpoint.ranges`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from keras_ft import events, threads
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.threads import Cancelled, Watermark

if TYPE_CHECKING:
    from keras_ft.checkpoint.remote import ObjectStorage

_T = TypeVar("_T")
_RETRIES = 4  # Attempts of each upload or download, with backoff between.
_BACKOFF_SECONDS = 0.25  # Before the second attempt; doubled for each next.

# Files this large or larger stream into a restore in ranges fetched
# concurrently: several connections download faster than one, and the
# checksum starts once the first range is in. A range is an eighth of the
# file within these bounds: each request costs a round trip and the server's
# fixed work (against the local S3 server, 8 MiB ranges of a 72 MB file
# downloaded slower than one GET; 16-36 MiB ones, 25-40 % faster).
STREAM_MIN = 16 << 20
STREAM_RANGE = 16 << 20
STREAM_RANGE_MAX = 64 << 20
STREAM_CONNECTIONS = 4
_STREAM_PARTS = 8


class RangedDownload:
    """One object downloaded in ranges on the transfer threads, written in
    place into a local file of its manifest size; `wait_for(n)` returns once
    its first n bytes are there.

    An object of another size than the manifest's, a range that cannot be
    fetched, or `stop()` end the download: waiters then get an `OSError`.
    """

    def __init__(
        self, storage: ObjectStorage, checkpoint: Checkpoint, name: str, path: str,
        size: int, shown: events.Progress | None = None,
    ):  # fmt: skip
        self.name, self.size = name, size
        self._key = storage._key(checkpoint, name)
        self._shown = shown  # The checkpoint's download, moved along.
        self._fs = storage.fs
        self._arrived = Watermark(size)
        self._done: set[int] = set()  # Range starts written past the watermark.
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        os.ftruncate(self._fd, size)
        share = -(-size // _STREAM_PARTS)
        self._range = min(max(STREAM_RANGE, share), STREAM_RANGE_MAX)
        starts = range(0, size, self._range)
        # Each connection fetches every n-th range, in order: the file
        # fills from its start, with at most n requests in flight.
        n = min(STREAM_CONNECTIONS, len(starts))
        self._futures = [
            threads.in_thread(self._fetch_every, starts[i::n], name="keras-ft-transfer")
            for i in range(n)
        ]

    def _fetch_every(self, starts: range) -> None:
        try:
            for start in starts:
                if self._error is not None:  # Called off, or a range failed.
                    return
                self._fetch(start)
        except BaseException as e:
            self._fail(e)

    def _fetch(self, start: int) -> None:
        end = min(start + self._range, self.size)
        # The last range asks for one byte more: an object longer than its
        # manifest says returns it.
        asked = end + 1 if end == self.size else end
        data = retried(lambda: self._fs.cat_file(self._key, start=start, end=asked))
        if len(data) != end - start:
            raise OSError(
                errno.EIO,
                f"{self.name} is not the size its manifest says ({self.size} bytes)",
            )
        view, offset = memoryview(data), start
        while view.nbytes:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written
        with self._lock:
            self._done.add(start)
            level = self._arrived.level
            while level in self._done:
                self._done.discard(level)
                level = min(level + self._range, self.size)
            if self._shown is not None:
                self._shown.add(level - self._arrived.level)
            self._arrived.advance(level)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._arrived.abandon(error)

    def wait_for(self, level: int) -> None:
        """Returns once the file's first `level` bytes are written.

        Raises:
            OSError: if the download failed or was stopped first.
        """
        try:
            self._arrived.wait_for(level)
        except Cancelled:
            error = self._error
            if isinstance(error, OSError):
                raise error from None
            raise OSError(errno.EIO, f"{self.name}: {error!r}") from error

    def stop(self) -> None:
        """Calls off the ranges not yet fetched, waits for the others, and
        closes the file."""
        self._fail(OSError(errno.ECANCELED, "the download was called off"))
        for future in self._futures:
            with contextlib.suppress(BaseException):
                future.result()
        os.close(self._fd)
        if self._shown is not None:
            self._shown.close()  # Its line ends, whole or not.


class Refused(Exception):
    """A conditional write found the object there, or changed since read."""


def as_os_error(action: Callable[[], _T], what: str) -> _T:
    """`action()`, retried; a failure is an `OSError`, as a disk's would be."""
    try:
        return retried(action)
    except (FileNotFoundError, Refused):
        raise
    except Exception as e:  # Any backend's error is a failed write.
        raise OSError(
            getattr(e, "errno", None) or errno.EIO,
            f"{what} failed after {_RETRIES} attempts ({type(e).__name__}: {e})",
        ) from e


def retried(action: Callable[[], _T]) -> _T:
    """`action()`, tried again with backoff on an error (not a missing file)."""
    for attempt in range(_RETRIES):
        try:
            return action()
        except (FileNotFoundError, Refused):
            raise
        except Exception:  # Network and service errors differ by backend.
            if attempt == _RETRIES - 1:
                raise
            time.sleep(_BACKOFF_SECONDS * 2**attempt)
    raise AssertionError("unreachable")


def moves(shown: events.Progress | None) -> Any:
    """An fsspec callback that adds one file's bytes to `shown` as they move
    (fsspec's default, which does nothing, without one)."""
    from fsspec.callbacks import DEFAULT_CALLBACK, Callback

    if shown is None:
        return DEFAULT_CALLBACK

    class Moved(Callback):
        counted = 0

        def call(self, *args: Any, **kwargs: Any) -> None:
            value = int(self.value or 0)
            if value > self.counted:
                shown.add(value - self.counted)
                self.counted = value

    return Moved()
