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
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from keras_ft import compat, events, threads
from keras_ft.backend import cross_process

# sysexits.h's EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
RETRYABLE_EXIT_CODE = 75


class SignalSentinel:
    """Calls `on_signal(signum)` in the sentinel's thread for each of
    `signals` the process receives, even while the main thread is blocked in
    C code, from `install()` (main thread) to `close()`.

    The interpreter has one wakeup file descriptor per process, so one
    thread reads it for every sentinel: it is started by the first
    `install()` and then kept for the life of the process, reused on purpose
    by every later `fit()` (a pipe and a thread blocked reading it). Where
    something else already owns the wakeup descriptor (asyncio's event loop,
    in a notebook kernel), it is left alone and `install()` returns `False`:
    the grace period then starts from the Python handler only.

    Args:
        signals: The signals to report.
        on_signal: Called in the sentinel's thread with the signal's number.
    """

    def __init__(
        self, signals: tuple[signal.Signals, ...], on_signal: Callable[[int], None]
    ):
        self.signals = {int(s) for s in signals}
        self.on_signal = on_signal

    def install(self) -> bool:
        """Starts reporting (main thread only); `False` where it cannot."""
        if threading.current_thread() is not threading.main_thread():
            return False
        return _wakeups.add(self)

    def close(self) -> None:
        """Stops reporting."""
        _wakeups.discard(self)


class _WakeupReader:
    """The process's one reader of the interpreter's wakeup descriptor (a
    pipe and a daemon thread blocked reading it), the sentinels it reports
    each signal to (see `SignalSentinel`), and the signals a forking thread
    holds back (`hold_back()`)."""

    def __init__(self) -> None:
        self.sentinels: set[SignalSentinel] = set()
        self.lock = threading.Lock()
        self.write_fd: int | None = None  # The pipe's end signals are written to.
        # The forking thread's signal mask before `hold_back()`, if any.
        self.forking = threading.local()

    def add(self, sentinel: SignalSentinel) -> bool:
        """Reports to `sentinel` from now on, if the wakeup descriptor is (or
        now becomes) the reader's pipe (main thread); else `False`."""
        if self.write_fd is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            threads.start_daemon(lambda: self._read(read), "keras-ft-signals")
            self.write_fd = write
        try:
            current = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return False
        if current not in (-1, self.write_fd):
            signal.set_wakeup_fd(current)  # Someone else's: theirs to keep.
            return False
        with self.lock:
            self.sentinels.add(sentinel)
        return True

    def discard(self, sentinel: SignalSentinel) -> None:
        with self.lock:
            self.sentinels.discard(sentinel)

    def forget_in_child(self) -> None:
        """See `forget_in_child()`."""
        write, self.write_fd = self.write_fd, None
        self.sentinels = set()
        self.lock = threading.Lock()
        if write is None:
            return
        with contextlib.suppress(ValueError, OSError):
            current = signal.set_wakeup_fd(-1)
            if current != write:
                signal.set_wakeup_fd(current)  # Someone else's: theirs to keep.
        with contextlib.suppress(OSError):
            os.close(write)

    def _read(self, read: int) -> None:
        while True:
            data = os.read(read, 64)
            with self.lock:
                listening = list(self.sentinels)
            for signum in data:
                for sentinel in listening:
                    if signum in sentinel.signals:
                        try:
                            sentinel.on_signal(signum)
                        except Exception:  # A bug must not end the reading.
                            traceback.print_exc()


# Process-wide: the interpreter has one wakeup descriptor and one signal
# disposition per process, so its reader (a thread) outlives every fit(),
# reused on purpose by the next.
_wakeups = _WakeupReader()


def hold_back(signals: set[signal.Signals]) -> None:
    """Blocks `signals` in this thread until `let_through()` (across a fork)."""
    _wakeups.forking.mask = (
        signal.pthread_sigmask(signal.SIG_BLOCK, signals) if signals else None
    )


def let_through() -> None:
    """Restores the mask `hold_back()` changed: what was held back arrives."""
    mask, _wakeups.forking.mask = getattr(_wakeups.forking, "mask", None), None
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def forget_in_child() -> None:
    """Leaves a forked child out of signal reporting (call in the child).

    The child (a Keras worker process loading a PyDataset) inherits the
    wakeup descriptor, the pipe the parent's reader thread reads, but not
    that thread: a signal to the child (`multiprocessing.Pool` ends its
    workers with SIGTERM) would reach the parent's sentinels as if the parent
    had been sent it, and start its grace period. The child gets a lock of
    its own too: its copy may have been held at the fork.
    """
    _wakeups.forget_in_child()


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


# The smallest bound of the adaptive deadline (`stall_timeout=None`/"auto").
STALL_FLOOR_SECONDS = 120.0
# How often a deadline is looked at, and the longest a process that must
# outlive its peers waits for their deadlines to end them.
_POLL_SECONDS = 0.5
_MAX_LINGER_SECONDS = 30.0


def start_deadline(
    stall_timeout: float | str | bool | None,
    first_batch_timeout: float,
    num_workers: int,
    describe: Callable[[], str],
    running: Callable[[], bool],
    loads_in_processes: bool = False,
    peers_first: bool = False,
) -> ProgressDeadline | None:
    """The deadline `BackupAndRestore(stall_timeout=...)` asks for, or `None`.

    `None` turns it on with the adaptive bound where a process other than
    this one can stall it for ever: in a multi-process run (one stuck process
    stalls them all), and where the input loads in worker processes
    (`loads_in_processes`: Keras waits without a bound for the item of a
    worker that was killed). `"auto"` turns it on everywhere; a number is a
    fixed bound; `False` turns it off. `peers_first`: see `ProgressDeadline`.
    """
    if stall_timeout is False or (
        stall_timeout is None and num_workers <= 1 and not loads_in_processes
    ):
        return None
    seconds = None if stall_timeout in (None, "auto") else float(stall_timeout)
    return ProgressDeadline(
        first_batch_timeout,
        seconds,
        floor_seconds=STALL_FLOOR_SECONDS,
        describe=describe,
        running=running,
        peers_first=peers_first,
    )


class FitDeadline:
    """The step deadline of one `BackupAndRestore` over its `fit()` calls.

    Started at train begin (`start()`), told of what counts as progress
    (batch ends, validation batches, the start of an epoch) and closed at
    train end (`stop()`). A deadline only the input asked for (worker
    processes loading a `PyDataset`, in one process) bounds the waits for
    batches, not the work of other callbacks between epochs (saving a large
    model): it is held from an epoch's last batch to the next epoch, and
    runs again during validation, which reads its input too.

    A batch's end may be heard on Keras' callback thread (`async_safe`), the
    rest on the training thread: the hold is taken under a lock.
    """

    def __init__(self) -> None:
        self._deadline: ProgressDeadline | None = None
        self._input_only = False
        self._held = False
        self._in_test = False
        self._lock = threading.RLock()

    def __deepcopy__(self, memo: dict) -> FitDeadline:
        # Keras Tuner deep-copies the callbacks of each trial, before fit().
        return FitDeadline()

    def start(
        self,
        stall_timeout: float | str | bool | None,
        first_batch_timeout: float,
        task: Any,
        callback_list: Any,
        position: Callable[[], tuple[int, int]],
        epoch_iterator: Any,
    ) -> None:
        """Starts the deadline `stall_timeout` asks for (`start_deadline()`),
        for the `fit()` calling `callback_list` and reading `epoch_iterator`:
        once that `fit()` is no longer on the main thread's stack (it
        raised), a silence is not a stall. `position()` is the epoch and the
        batches trained in it, for the message."""

        def describe() -> str:
            epoch, batches = position()
            where = f"epoch {epoch + 1}, batch {batches + 1}"
            if task.num_workers > 1:
                where += f" (on worker {task.task_index} of {task.num_workers})"
            return where

        loads_in_processes = compat.loads_in_processes(epoch_iterator)
        # Where the coordination service lives in process 0, the others
        # abort (SIGABRT, not the retryable 75) as soon as it is gone.
        peers_first = (
            task.num_workers > 1
            and task.task_index == 0
            and cross_process.coordinator_in_process_zero()
        )
        self.stop()  # Left by a fit() that raised.
        fit_calls = weakref.ref(callback_list) if callback_list is not None else None

        def running() -> bool:
            held = fit_calls() if fit_calls is not None else None
            return held is not None and compat.stack_holds(
                compat.main_thread_frame(), held
            )

        self._input_only = (
            loads_in_processes and task.num_workers <= 1 and stall_timeout is None
        )
        self._held = self._in_test = False
        self._deadline = start_deadline(
            stall_timeout,
            first_batch_timeout,
            task.num_workers,
            describe,
            running if fit_calls is not None else (lambda: True),
            loads_in_processes=loads_in_processes,
            peers_first=peers_first,
        )

    def stop(self) -> None:
        if self._deadline is not None:
            self._deadline.close()
            self._deadline = None

    def epoch_begin(self) -> None:
        if self._held:
            self._hold(False)
        elif self._deadline is not None:  # Past validation and epoch-end saves.
            self._deadline.progressed()

    def batch_ended(self, last_of_epoch: bool) -> None:
        """On the training thread or Keras' callback thread."""
        deadline = self._deadline
        if deadline is not None:
            deadline.batch_ended()
            with self._lock:
                # Heard late, once validation began: held after it instead.
                if last_of_epoch and not self._in_test:
                    self._hold(True)

    def epoch_end(self) -> None:
        self._hold(True)  # Where the epoch's length was not known.

    def test_begin(self) -> None:
        with self._lock:
            # Validation comes once the epoch's batches are over (the last
            # one's end may not be heard yet): held again after it.
            self._in_test = True
            self._hold(False)

    def test_batch_ended(self) -> None:
        if self._deadline is not None:  # Validation is progress too.
            self._deadline.batch_ended()

    def test_end(self) -> None:
        with self._lock:
            self._in_test = False
            self._hold(True)

    def _hold(self, held: bool) -> None:
        """Holds a deadline only the input asked for (`True`), or lets it
        run again (`False`)."""
        with self._lock:
            deadline = self._deadline
            if deadline is None or not self._input_only or held == self._held:
                return
            self._held = held
            if held:
                deadline.pause()
            else:
                deadline.resume()


def _exit_now(code: int) -> None:
    # The process's own worker processes (Keras' for a PyDataset) would
    # outlive an os._exit(), which skips multiprocessing's clean-up.
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    os._exit(code)


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
        peers_first: This process hosts a service whose end aborts the
            other processes (JAX's coordination service, in process 0): once
            its deadline has passed, it waits a little longer before it
            exits, so that the others' deadlines (which passed at most about
            a batch later) end them with the retryable status, not JAX's
            abort.
        exit: Ends the process; `os._exit` but in tests.
    """

    def __init__(
        self,
        first_batch_seconds: float,
        seconds: float | None = None,
        factor: float = 10.0,
        floor_seconds: float = STALL_FLOOR_SECONDS,
        describe: Callable[[], str] = lambda: "the next batch",
        running: Callable[[], bool] = lambda: True,
        peers_first: bool = False,
        exit: Callable[[int], None] = _exit_now,
    ):
        self.first_batch_seconds = first_batch_seconds
        self.seconds = seconds
        self.factor = factor
        self.floor_seconds = floor_seconds
        self.describe = describe
        self.running = running
        self.peers_first = peers_first
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

    def progressed(self) -> None:
        """Restarts the clock without counting a batch (an epoch began): the
        first batch keeps `first_batch_seconds`."""
        with self._lock:
            self._last = time.monotonic()

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
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def pause(self) -> None:
        """No deadline until `resume()` (pauses nest)."""
        with self._lock:
            self._paused += 1

    def resume(self) -> None:
        """Ends a `pause()`; the time paused does not count."""
        with self._lock:
            self._paused -= 1
            self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(_POLL_SECONDS):
            with self._lock:
                if self._paused:
                    continue
                waited, bound = time.monotonic() - self._last, self.bound()
            if waited > bound:
                if not self.running():
                    return  # That fit() raised long ago: not a stall.
                events.say(
                    "stall",
                    f"BackupAndRestore: no batch ended for {waited:.0f} s (the "
                    f"bound is {bound:.0f} s) while waiting for "
                    f"{self.describe()}: the training is stuck (a peer that "
                    "died or froze, a deadlock, a stalled read). Exiting with "
                    f"status {RETRYABLE_EXIT_CODE} so the job can be restarted "
                    "from its last backup, which is intact.",
                    level=logging.ERROR,
                )
                if self.peers_first:
                    time.sleep(self.linger_seconds())
                self._exit(RETRYABLE_EXIT_CODE)
                return

    def linger_seconds(self) -> float:
        """How long a `peers_first` process waits past its deadline: the
        others' last batch ended at most about a batch after its own, and
        each deadline is looked at every `_POLL_SECONDS`."""
        with self._lock:
            slowest = self._slowest
        return min(slowest + 3 * _POLL_SECONDS, _MAX_LINGER_SECONDS)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
