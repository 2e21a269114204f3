"""Bounds that hold when the training thread cannot act: a stall deadline,
and signals seen by a thread.

Python runs a signal handler only when the main thread returns to Python
code, so a main thread blocked inside a collective (a peer that froze or
deadlocked), a stalled read or a deadlock runs no handler and checks no
time: every bound here is enforced by a thread of its own.

- `SignalSentinel` learns of a signal through `signal.set_wakeup_fd()`, which
  the interpreter's C-level handler writes to at once, whatever the main
  thread is doing; the preemption's grace period starts there.
- `ProgressDeadline` ends the process when no batch has ended for too long,
  printing what it was waiting for, with `RETRYABLE_EXIT_CODE`: in a cluster
  every process is then stuck on the same step, and each one's deadline
  ends it, so the scheduler can restart the job from its last backup.

Exit codes, for a scheduler: 0 finished; 128 + the signal (143 for SIGTERM)
preempted, with a final backup or, if it could not be written in the grace
period, without one (said on stdout); `RETRYABLE_EXIT_CODE` (75, `EX_TEMPFAIL`)
a stall: relaunch; anything else (1: a Python exception) an error in the
model, the data or the arguments: do not retry blindly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from keras_ft import threads

# sysexits.h's EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
RETRYABLE_EXIT_CODE = 75


class SignalSentinel:
    """Calls `on_signal(signum)` in a thread of its own for each of `signals`
    the process receives, even while the main thread is blocked in C code.

    The interpreter's wakeup file descriptor is process-wide: one set before
    (asyncio's, in a notebook kernel) is handed every byte this one reads,
    and put back by `close()`.

    Args:
        signals: The signals to report; others are only passed on.
        on_signal: Called in the sentinel's thread with the signal's number.
    """

    def __init__(
        self, signals: tuple[signal.Signals, ...], on_signal: Callable[[int], None]
    ):
        self.signals = {int(s) for s in signals}
        self.on_signal = on_signal
        self._read: int | None = None
        self._write: int | None = None
        self._previous = -1
        self._thread: threading.Thread | None = None

    def install(self) -> bool:
        """Starts watching (main thread only); `False` where it cannot."""
        if threading.current_thread() is not threading.main_thread():
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return False
        self._read, self._write = read, write
        self._thread = threads.start_daemon(self._watch, "keras-ft-signals")
        return True

    def _watch(self) -> None:
        read = self._read
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return  # Closed by `close()`.
            if not data:
                return
            if self._previous >= 0:  # Whoever listened before us hears it too.
                with contextlib.suppress(OSError):
                    os.write(self._previous, data)
            for signum in data:
                if signum in self.signals:
                    self.on_signal(signum)

    def close(self) -> None:
        """Stops watching and puts the earlier wakeup descriptor back."""
        if self._write is None:
            return
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                current = signal.set_wakeup_fd(self._previous)
                if current != self._write:  # Replaced after us: leave theirs.
                    signal.set_wakeup_fd(current)
        write, self._write = self._write, None
        os.close(write)  # Ends the thread's read with end-of-file.
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        read, self._read = self._read, None
        with contextlib.suppress(OSError):
            os.close(read)


def check_stall_timeout(value: object, first_batch_timeout: object) -> None:
    """Raises a `ValueError` naming the argument for a bad stall bound."""
    if not (
        value is None
        or value is False
        or value == "auto"
        or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value > 0
        )
    ):
        raise ValueError(
            "Invalid value for argument `stall_timeout`. Expected None (on in a "
            "multi-process run), 'auto', a positive number of seconds, or False "
            f"(off). Received: stall_timeout={value!r}"
        )
    if (
        not isinstance(first_batch_timeout, (int, float))
        or isinstance(first_batch_timeout, bool)
        or first_batch_timeout <= 0
    ):
        raise ValueError(
            "Invalid value for argument `first_batch_timeout`. Expected a positive "
            "number of seconds. Received: "
            f"first_batch_timeout={first_batch_timeout!r}"
        )


def start_deadline(
    stall_timeout: float | str | bool | None,
    first_batch_timeout: float,
    num_workers: int,
    describe: Callable[[], str],
    running: Callable[[], bool],
) -> ProgressDeadline | None:
    """The deadline `BackupAndRestore(stall_timeout=...)` asks for, or `None`.

    `None` turns it on in a multi-process run (one stuck process stalls them
    all) with the adaptive bound; `"auto"` everywhere; a number is a fixed
    bound; `False` turns it off.
    """
    if stall_timeout is False or (stall_timeout is None and num_workers <= 1):
        return None
    seconds = None if stall_timeout in (None, "auto") else float(stall_timeout)
    return ProgressDeadline(
        first_batch_timeout, seconds, describe=describe, running=running
    )


class ProgressDeadline:
    """Ends the process when no batch ends in time.

    The first batch (which compiles) gets `first_batch_seconds`; after it, a
    batch may take `seconds`, or with `seconds=None`, the larger of `factor`
    times the slowest batch seen and `floor_seconds`.

    Args:
        first_batch_seconds: The bound for the first batch of a `fit()`.
        seconds: A fixed bound for every later batch, or `None`.
        factor: With `seconds=None`, how many times the slowest batch seen.
        floor_seconds: With `seconds=None`, the smallest bound.
        describe: Returns what training waits for ("epoch 3, batch 41"),
            called from the deadline's thread.
        running: Whether the training is still running (a `fit()` that
            raised never says it ended); once not, the deadline stops.
        exit: Ends the process; `os._exit` but in tests.
    """

    def __init__(
        self,
        first_batch_seconds: float,
        seconds: float | None = None,
        factor: float = 10.0,
        floor_seconds: float = 120.0,
        describe: Callable[[], str] = lambda: "the next batch",
        running: Callable[[], bool] = lambda: True,
        exit: Callable[[int], None] = os._exit,
    ):
        self.first_batch_seconds = first_batch_seconds
        self.seconds = seconds
        self.factor = factor
        self.floor_seconds = floor_seconds
        self.describe = describe
        self.running = running
        self._exit = exit
        self._last = time.monotonic()
        self._slowest = 0.0
        self._batches = 0
        self._paused = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threads.start_daemon(self._run, "keras-ft-deadline")

    def bound(self) -> float:
        """Seconds the current batch may take."""
        if self._batches == 0:
            return self.first_batch_seconds
        if self.seconds is not None:
            return self.seconds
        return max(self.factor * self._slowest, self.floor_seconds)

    def batch_ended(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._batches:
                self._slowest = max(self._slowest, now - self._last)
            self._batches += 1
            self._last = now

    @contextlib.contextmanager
    def paused(self):
        """No deadline inside the block (a restore, an evaluation, a final
        save): what is not a training batch is bounded elsewhere or not at
        all."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                if self._paused:
                    continue
                waited, bound = time.monotonic() - self._last, self.bound()
            if waited > bound:
                if not self.running():
                    return  # That fit() raised long ago: not a stall.
                sys.stdout.write(
                    f"BackupAndRestore: no batch ended for {waited:.0f} s (the "
                    f"bound is {bound:.0f} s) while waiting for "
                    f"{self.describe()}: the training is stuck (a peer that "
                    "died or froze, a deadlock, a stalled read). Exiting with "
                    f"status {RETRYABLE_EXIT_CODE} so the job can be restarted "
                    "from its last backup, which is intact.\n"
                )
                sys.stdout.flush()
                self._exit(RETRYABLE_EXIT_CODE)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
