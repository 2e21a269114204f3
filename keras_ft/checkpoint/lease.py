"""One writer per prefix of a bucket: the lease, and the conditional writes
it is made of.

There is no `flock` on a bucket, so the writer holds a lease, an object
`.lease.json` with its host, pid and a heartbeat it renews every few
seconds. Another writer may take it over only when the heartbeat is older
than `KERAS_FT_LEASE_SECONDS` (default 30), or when the holder is a process
on the same host that no longer runs. On S3 every write of it is
conditional (`If-None-Match: *`, `If-Match: <ETag>`): two writers never both
hold it. Elsewhere it is best effort, which keras-ft says once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from keras_ft import events, holdings, threads
from keras_ft.checkpoint.transfers import Refused
from keras_ft.errors import DirectoryInUseError, LeaseLapsedError

if TYPE_CHECKING:
    from keras_ft.checkpoint.remote import ObjectStorage

LEASE_FILE = ".lease.json"
LEASE_SECONDS_ENV = "KERAS_FT_LEASE_SECONDS"
# Stores whose fsspec filesystem passes S3's conditional writes on.
_CONDITIONAL = ("s3", "s3a")
# One process's memory: no other writer to race with.
_LOCAL_ONLY = ("memory",)


class RemoteLease:
    """One writer per prefix of a bucket: a lease object with a heartbeat.

    Args:
        store: The store whose prefix to hold.
        seconds: How old a heartbeat must be before another writer may take
            the lease over. Defaults to `KERAS_FT_LEASE_SECONDS` or 30.
    """

    def __init__(self, store: ObjectStorage, seconds: float | None = None):
        self.fs = store.fs
        self.directory = store.location
        self.key = f"{store.root}/{LEASE_FILE}"
        # Its name among what this process holds: the same path on another
        # server is another lease.
        self._ident = f"{store.identity}/{LEASE_FILE}"
        self.seconds = (
            seconds
            if seconds is not None
            else float(os.environ.get(LEASE_SECONDS_ENV, "30"))
        )
        self._token: str | None = None
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None
        self._renewed = 0.0  # time.monotonic() of the last heartbeat written.
        self._failure: Exception | None = None  # Of the beats since then.
        self._taken: dict | None = None  # Another writer's lease, found after a lapse.
        self._conditional = conditional_writes(self.fs)
        self._etag: str | None = None  # Of the lease as this writer last wrote it.

    def _read(self) -> dict | None:
        try:
            with self.fs.open(self.key, "rb") as f:
                value = json.loads(f.read(1 << 16))
        except (FileNotFoundError, ValueError, RecursionError):
            return None
        return value if isinstance(value, dict) else None

    def _etag_now(self) -> str | None:
        """The lease object's ETag, or `None` if there is none."""
        try:
            return self.fs.info(self.key, refresh=True).get("ETag")
        except FileNotFoundError:
            return None

    def _write(self, over: str | None = None) -> None:
        """Writes this writer's lease. Where the store has conditional
        writes, only over the object whose ETag is `over` (created if
        `over` is `None`); `Refused` if another write came first."""
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self._token,
            "heartbeat": time.time(),
        }
        data = json.dumps(holder).encode()
        if not self._conditional:
            self.fs.pipe_file(self.key, data)
            return
        written = put_if(self.fs, self.key, data, over)
        etag = written.get("ETag") if isinstance(written, dict) else None
        self._etag = etag or self._etag_now()

    def acquire(self) -> None:
        """Takes the lease, or raises `DirectoryInUseError` naming its holder."""
        if self._token is not None:
            return
        # The ETag first: if the object changes after, the conditional
        # write over it is refused (another writer is active).
        seen = self._etag_now() if self._conditional else None
        held = self._read()
        if held is not None and not self._expired(held):
            raise self._in_use(held)
        # A fit() that raised keeps its lease, as it keeps a flock, until a
        # later fit() here takes it: that one stops the earlier heartbeat,
        # which would otherwise beat for as long as the process lives.
        earlier = holdings.get("lease", self._ident)
        if earlier is not None and earlier is not self:
            earlier._yield_to_this_process()
        self._token, self._taken = secrets.token_hex(8), None
        if self._conditional:
            try:
                self._write(over=seen)
            except Refused:
                self._token = None
                raise self._in_use(self._read() or {}) from None
        else:
            _warn_best_effort(self.fs, self.directory)
            self._write()
            # Two writers that both found it free: the last write wins; the
            # other sees a token not its own and backs off.
            time.sleep(0.2)
            held = self._read()
            if held is None or held.get("token") != self._token:
                self._token = None
                raise self._in_use(held or {})
        self._renewed, self._failure = time.monotonic(), None
        self._stop.clear()
        self._beating = threads.start_daemon(self._heartbeat, "keras-ft-lease")
        holdings.put("lease", self._ident, self)
        events.log("lease", f"took the lease on {self.directory}")

    def _yield_to_this_process(self) -> None:
        """A later lease of this process takes the prefix: this one stops
        beating, and refuses its commits (`check`) if its fit() goes on."""
        self._taken = {"pid": os.getpid(), "host": socket.gethostname()}
        self._stop_beating()

    def _stop_beating(self) -> None:
        self._stop.set()
        beating, self._beating = self._beating, None
        if beating is not None and beating is not threading.current_thread():
            beating.join(timeout=30)  # At most one write of the lease.

    def _heartbeat(self) -> None:
        while not self._stop.wait(max(self.seconds / 3, 0.5)):
            if self._token is None or self._taken is not None:
                return  # Released, or taken over: never written again.
            try:
                if not self._conditional and (
                    time.monotonic() - self._renewed > self.seconds
                ):
                    # Lapsed: another writer may hold it now; never write
                    # over its lease (both would then commit).
                    held = self._read()
                    if held is not None and held.get("token") != self._token:
                        self._taken = held
                        return
                self._write(over=self._etag)
            except Refused:  # Written since: by another (taken over), or by
                # this writer's own last beat whose answer was lost.
                held = self._read() or {}
                if held.get("token") == self._token:
                    self._etag = self._etag_now()
                else:
                    self._taken = held
                    events.log(
                        "lease",
                        f"the lease on {self.directory} was taken over by pid "
                        f"{held.get('pid')} on {held.get('host')}",
                        logging.ERROR,
                    )
                    return
            except Exception as e:  # Retried at the next beat; see check().
                self._failure = e
                events.log(
                    "lease",
                    f"could not renew the lease on {self.directory} "
                    f"({type(e).__name__}: {e}); retried at the next beat",
                    logging.WARNING,
                )
            else:
                self._renewed, self._failure = time.monotonic(), None

    def check(self) -> None:
        """Raises if the lease may have gone to another writer: its heartbeat
        could not be written for longer than a takeover waits. A writer
        calls it before each commit.

        Raises:
            LeaseLapsedError: naming the last heartbeat's error.
        """
        if self._token is None:
            return
        if self._taken is not None:
            raise LeaseLapsedError(
                errno.EBUSY,
                f"The lease on {self.directory} lapsed and was taken over by "
                f"another training (pid {self._taken.get('pid')} on "
                f"{self._taken.get('host')}), so this save is not committed. "
                "Stop one of the two trainings; the next fit() of this one "
                "waits for the other's lease to expire.",
            )
        silent = time.monotonic() - self._renewed
        if silent > self.seconds:
            raise LeaseLapsedError(
                errno.EBUSY,
                f"The lease on {self.directory} was not renewed for {silent:.0f} s "
                f"(last error: {type(self._failure).__name__}: {self._failure}); "
                "another training may have taken the backup over, so this save "
                "is not committed. Check that the bucket is reachable; the next "
                "fit() takes the lease again.",
            )

    def release(self, remove: bool = False) -> None:
        """Gives the lease back: its object is removed if it is still ours."""
        self._stop_beating()
        token, self._token = self._token, None
        holdings.pop("lease", self._ident, self)
        if token is None:
            return
        try:
            held = self._read()
            if held is not None and held.get("token") == token:
                self.fs.rm_file(self.key)
                events.log("lease", f"gave back the lease on {self.directory}")
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


def put_if(fs: Any, key: str, data: bytes, over: str | None = None) -> Any:
    """`fs.pipe_file()`, conditional: the object is created only if absent
    (`over` is `None`), or replaced only if its ETag is `over`.

    Returns:
        The store's answer (on S3, with the new ETag).

    Raises:
        Refused: if the condition does not hold.
    """
    condition = {"mode": "create"} if over is None else {"IfMatch": over}
    try:
        return fs.pipe_file(key, data, **condition)
    except FileExistsError:
        raise Refused() from None
    except Exception as e:  # Network and service errors differ.
        if _precondition_failed(e):
            raise Refused() from None
        raise


def _warn_best_effort(fs: Any, directory: str) -> None:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in _LOCAL_ONLY or not events.first_time("best effort", protocol):
        return
    events.warn(
        "lease",
        f"keras-ft: the lease on {directory} is best effort: {protocol}:// "
        "offers keras-ft no conditional write, so two trainings started "
        "within one round trip of each other may both write. Make sure one "
        "training at a time uses a backup_dir (S3 has no such gap).",
        stacklevel=4,
    )


def conditional_writes(fs: Any) -> bool:
    """Whether `fs` passes S3's conditional writes on (see the module)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in _CONDITIONAL


def _precondition_failed(error: Exception) -> bool:
    """Whether a conditional write was refused: the object exists, or
    changed since it was read (S3 answers 412 Precondition Failed; clients
    raise their own types, s3fs an `OSError` with S3's message)."""
    text = f"{type(error).__name__} {error}"
    return any(
        marker in text for marker in ("PreconditionFailed", "412", "pre-condition")
    )
