"""Preemption: turn SIGTERM/SIGINT into "save now and stop".

Cloud VMs are preempted with a SIGTERM and a grace period (30 s on GCP, 2 min
notice on AWS spot). `PreemptionWatcher` records the signal; the callback
saves at the next batch end and stops `fit()`. A handler installed before is
still called (after ours); the old handlers are put back at train end. If no
batch end comes within the grace period (training hung, or ended by an
exception without reaching train end), the process exits as the signal would
have made it, rather than ignore it. A second signal of the same kind while
the first is pending is delivered to the old handler at once.

Keras calls no callback when `fit()` raises, so the handlers can outlive the
training they were installed for. A handler that finds its training no longer
running (no frame on the stack holds the object it was installed with) steps
aside: it puts the old handlers back and passes the signal on, so Ctrl-C in a
notebook after a failed `fit()` is a plain `KeyboardInterrupt` again.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from keras_ft import compat, events, threads
from keras_ft.training.watchdog import (
    SignalSentinel,
    forget_in_child,
    hold_back,
    let_through,
)


def parse_signals(value: Iterable[Any] | None) -> tuple[signal.Signals, ...]:
    """Signal names (`"SIGTERM"`) or numbers as `signal.Signals`; None: none."""
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        value = [value]
    parsed = []
    for item in value:
        try:
            if isinstance(item, str):
                parsed.append(signal.Signals[item.upper()])
            else:
                parsed.append(signal.Signals(item))
        except (KeyError, ValueError):
            raise ValueError(
                "Invalid value for argument `preemption_signals`. Expected "
                'signal names or numbers, e.g. ("SIGTERM", "SIGINT"), or None. '
                f"Received: preemption_signals={value!r}"
            ) from None
    return tuple(parsed)


class PreemptionWatcher:
    """Installs signal handlers that request a save-and-stop.

    Args:
        signals: The signals to watch.
        grace_period: Seconds the process may take to save and stop after
            a signal before it exits anyway.
    """

    def __init__(self, signals: tuple[signal.Signals, ...], grace_period: float):
        self.signals = signals
        self.grace_period = grace_period
        self.received: signal.Signals | None = None
        self.received_at = 0.0
        self.handled = False
        self._previous: dict[signal.Signals, Any] = {}
        self._timer: threading.Timer | None = None
        self._timer_lock = threading.Lock()
        self._training: Callable[[], Any] | None = None
        # Seen by the sentinel's thread: the grace period runs even while
        # the main thread, blocked, runs no handler.
        self._sentinel: SignalSentinel | None = None
        self._seen: signal.Signals | None = None

    def install(self, training: Any = None) -> bool:
        """Installs the handlers; only possible from the main thread.

        Args:
            training: An object that a frame of the training loop holds for
                as long as training runs (`fit()`'s `CallbackList`). Once no
                frame on the main thread's stack holds it, the handlers step
                aside. `None`: they stay in charge until `uninstall()`.
                Defaults to `None`.
        """
        self.received, self.handled, self._seen = None, False, None
        if not self.signals:
            return False
        if threading.current_thread() is not threading.main_thread():
            events.warn(
                "preemption",
                "BackupAndRestore: fit() is not running in the main thread, so "
                "it cannot handle preemption signals; a SIGTERM will end "
                "training without a final backup.",
                stacklevel=3,
            )
            return False
        self.uninstall()  # Still in place if this watcher's last fit() raised.
        here = compat.current_frame()
        for signum in self.signals:
            _remove_stale_watchers(signum, here)
        self._training = _weak(training)
        for signum in self.signals:
            if signum not in self._previous:  # Else still called from a chain.
                self._previous[signum] = signal.signal(signum, self._handle)
        sentinel = SignalSentinel(self.signals, lambda s: None)
        sentinel.on_signal = functools.partial(self._seen_by_thread, sentinel=sentinel)
        with self._timer_lock:
            self._sentinel = sentinel if sentinel.install() else None
        return True

    def uninstall(self) -> None:
        """Puts the previous handlers back (main thread only)."""
        with self._timer_lock:
            # From here on the sentinel's thread starts no grace period.
            sentinel, self._sentinel = self._sentinel, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if threading.current_thread() is not threading.main_thread():
            return
        if sentinel is not None:
            sentinel.close()
        kept = {}
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
            else:
                # A handler installed after ours may still call ours: keep
                # knowing where to pass the signal on.
                kept[signum] = previous
        self._previous = kept

    def done(self) -> None:
        """The requested save happened: the fallback exit is no longer needed."""
        with self._timer_lock:
            self.handled = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    @property
    def seconds_since_signal(self) -> float:
        return time.monotonic() - self.received_at

    def training_running(self, frame: Any) -> bool:
        """Whether the training the handlers were installed for is running,
        judged from `frame` (the main thread's) and the frames below it."""
        if self._training is None:
            return True
        training = self._training()
        return training is not None and compat.stack_holds(frame, training)

    def _handle(self, signum: int, frame: Any) -> None:
        signum = signal.Signals(signum)
        if not self.training_running(frame):
            previous = self._previous.get(signum, signal.SIG_DFL)
            self.uninstall()
            _deliver(previous, signum, frame)
            return
        if self.received is not None:
            # A second signal while we are still saving: the user insists.
            previous = self._previous.get(signum, signal.SIG_DFL)
            self.uninstall()
            _deliver(previous, signum, frame)
            return
        self.received, self.received_at = signum, time.monotonic()
        self._start_grace(signum)
        previous = self._previous.get(signum)
        # Python's own SIGINT handler raises KeyboardInterrupt mid-step, which
        # is exactly what we are preventing; any other handler is chained.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def _seen_by_thread(self, signum: int, sentinel: SignalSentinel) -> None:
        """The sentinel's report, in its thread: starts the grace period if
        the main thread's handler has not (it may never run)."""
        if (
            self.handled
            # Our handler is not the one in force (another replaced it): the
            # signal is someone else's to handle.
            or signal.getsignal(signum) != self._handle
            or not self.training_running(compat.main_thread_frame())
        ):
            return
        self._start_grace(signal.Signals(signum), sentinel)

    def _start_grace(
        self, signum: signal.Signals, sentinel: SignalSentinel | None = None
    ) -> None:
        with self._timer_lock:
            if sentinel is not None and self._sentinel is not sentinel:
                return  # Uninstalled meanwhile: the signal is not ours any more.
            if self._timer is None and not self.handled:
                self._seen = signum
                self._timer = threads.call_later(self.grace_period, self._too_late)

    def __getstate__(self) -> dict:
        # Keras Tuner deep-copies the callbacks between trials: what a copy
        # needs is the configuration, not this fit()'s lock, timer or threads.
        state = dict(self.__dict__)
        state.update(_timer_lock=None, _timer=None, _sentinel=None, _training=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._timer_lock = threading.Lock()

    def _too_late(self) -> None:
        signum = self.received or self._seen
        if not self.handled and signum is not None:
            if self.received is None:
                events.say(
                    "preemption",
                    f"BackupAndRestore: {signum.name} arrived while the training "
                    "thread was blocked (a collective, a stalled read, a "
                    "deadlock), and it did not come back within the grace "
                    f"period ({self.grace_period:g} s).",
                    level=logging.WARNING,
                )
            self.received = signum
            if interrupted_interactively(self.received):
                # A notebook kernel is not ours to end: interrupt the cell.
                events.say(
                    "preemption",
                    f"BackupAndRestore: no batch ended within the grace period "
                    f"({self.grace_period:g} s) after the interrupt; stopping "
                    "without a final backup. The last committed backup is "
                    "intact: run the cell again to resume from it.",
                    level=logging.WARNING,
                )
                _thread.interrupt_main()
                return
            events.say(
                "preemption",
                f"BackupAndRestore: no batch ended within the grace period "
                f"({self.grace_period:g} s) after {self.received.name}; exiting "
                "without a final backup. The last committed backup is intact.",
                level=logging.WARNING,
            )
            os._exit(128 + int(self.received))


def check_grace_period(value: object) -> float:
    """`grace_period` as seconds, or a `ValueError` saying what it must be."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            "Invalid value for argument `grace_period`. Expected a positive "
            f"number of seconds. Received: grace_period={value!r}"
        )
    return float(value)


def interactive() -> bool:
    """Whether this process runs an IPython shell or a Jupyter kernel."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return callable(get_ipython) and get_ipython() is not None


def interrupted_interactively(signum: signal.Signals | None) -> bool:
    """Whether `signum` is a user's interrupt of a notebook cell or shell line,
    which should end that cell, not the process."""
    return signum == signal.SIGINT and interactive()


def exit_after(signum: signal.Signals) -> None:
    """Ends the process as `signum` asked, once the final backup is taken:
    `SystemExit` with status 128 + its number (no traceback), so a scheduler
    sees a preemption; in a notebook an interrupt ends the cell instead."""
    if interrupted_interactively(signum):
        raise KeyboardInterrupt(
            "BackupAndRestore: training stopped at the interrupt, "
            "backed up; run the cell again to continue."
        )
    raise SystemExit(128 + int(signum))


def _weak(obj: Any) -> Callable[[], Any] | None:
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:  # Not weakly referenceable: hold it.
        return lambda: obj


def _remove_stale_watchers(signum: signal.Signals, frame: Any) -> None:
    """Uninstalls watchers on top of `signum`'s chain whose training is over."""
    while True:
        handler = signal.getsignal(signum)
        if not _is_watcher(handler) or handler.__self__.training_running(frame):
            return
        handler.__self__.uninstall()
        if signal.getsignal(signum) == handler:
            return  # Could not step aside; leave the chain as it is.


# A process forked during fit() (Keras' worker processes for a PyDataset with
# `use_multiprocessing`) is not training: a signal must do to it what it would
# have done without keras-ft (`multiprocessing.Pool` ends its workers with
# SIGTERM; Ctrl-C reaches the whole process group), not start a grace period,
# in it or, through the wakeup pipe they share, in its parent. The forking
# thread holds the watched signals back across the fork, so that none reaches
# the child before it has stepped aside (a loaded machine may take
# milliseconds to run the child at all); the child then receives it as it
# would have without keras-ft.


def _watched_signals() -> set[signal.Signals]:
    watched = set()
    for signum in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            if _is_watcher(signal.getsignal(signum)):
                watched.add(signum)
    return watched


def _before_fork() -> None:
    hold_back(_watched_signals())


def _after_fork_in_child() -> None:
    for signum in _watched_signals():
        handler = signal.getsignal(signum)
        while _is_watcher(handler):
            handler = handler.__self__._previous.get(signum, signal.SIG_DFL)
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signum, handler)
    forget_in_child()
    let_through()  # What was held back arrives, as it now would.


def _is_watcher(handler: Any) -> bool:
    return isinstance(getattr(handler, "__self__", None), PreemptionWatcher) and (
        getattr(handler, "__func__", None) is PreemptionWatcher._handle
    )


if hasattr(os, "register_at_fork") and hasattr(signal, "pthread_sigmask"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=let_through,
        after_in_child=_after_fork_in_child,
    )


def _deliver(handler: Any, signum: signal.Signals, frame: Any) -> None:
    """Delivers a signal as `handler`, the disposition before ours, would."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        os.kill(os.getpid(), signum)  # SIG_DFL, now back in place.


class ClusterNotice:
    """Tells every worker of a cluster at which batch end to save and stop.

    Synchronous data-parallel workers train in lockstep: none can finish a
    step before every other has entered it. So a worker that got the signal
    at batch end `n` and publishes "stop at batch end `n + 1`" before its next
    step is seen by every other worker at batch end `n + 1` at the latest, and
    all of them take the final backup (a collective save) at the same step.
    The notice is written through the checkpoint store every worker reads (a
    shared disk or a bucket), with the store's create-if-absent: the first
    notice published wins, so two workers signalled at once still agree.

    Args:
        store: The store of the chief's checkpoints (`create_notice()`,
            `read_notice()`, `remove_notice()`).
        resumed_from: Optimizer step this run resumed at, so that a notice
            left by an earlier run is never taken for this one's.
    """

    NAME = "preempted.json"

    def __init__(self, store: Any, resumed_from: int):
        self.store = store
        self.resumed_from = resumed_from

    def clear(self) -> None:
        """Removes an earlier run's notice (the chief, before its first step)."""
        self.store.remove_notice(self.NAME)

    def publish(self, batch_end: int, signum: signal.Signals, worker: int) -> dict:
        """Publishes "stop at `batch_end`" unless a notice exists.

        Returns:
            The notice in force: this one, or the one published first.
        """
        notice = {
            "batch_end": batch_end,
            "signal": signum.name,
            "worker": worker,
            "resumed_from": self.resumed_from,
        }
        self.store.create_notice(self.NAME, json.dumps(notice).encode())
        # Read back: where a store has no conditional create, two notices
        # written at once leave the last one, which everybody then reads.
        return self.read() or notice

    def read(self) -> dict | None:
        """The notice for this run, if one was published."""
        data = self.store.read_notice(self.NAME)
        try:
            notice = json.loads(data) if data is not None else None
        except ValueError:
            return None
        if not isinstance(notice, dict) or notice.get("resumed_from") != (
            self.resumed_from
        ):
            return None
        if not isinstance(notice.get("batch_end"), int):
            return None
        if notice.get("signal") not in signal.Signals.__members__:
            return None
        return notice


class Preemption:
    """When to back up and stop for a signal, on one process or several.

    One process stops at the first batch end after the signal. Several
    workers stop together at the batch end a `ClusterNotice` names: a save
    is a collective read of the variables, so a signalled worker cannot
    save alone.

    Args:
        signals: The signals that mean "this machine is going away".
        grace_period: Seconds from the signal to the end of the final backup.
    """

    def __init__(self, signals: tuple[signal.Signals, ...], grace_period: float):
        self.watcher = PreemptionWatcher(signals, grace_period)
        self._notice: ClusterNotice | None = None
        self._batch_ends = 0
        self._stop_at: dict | None = None

    def start(
        self, training: Any, store: Any, num_workers: int, is_chief: bool,
        resumed_step: int,
    ) -> None:  # fmt: skip
        """Installs the handlers for the `fit()` that `training` stands for;
        `store` carries the cluster's notice (see `ClusterNotice`)."""
        # Keras calls no callback when fit() raises: the handlers check that
        # this fit's CallbackList is still on the stack when a signal comes.
        self.watcher.install(training=training)
        self._batch_ends, self._stop_at, self._notice = 0, None, None
        if num_workers > 1:
            self._notice = ClusterNotice(store, resumed_step)
            if is_chief:
                self._notice.clear()

    def stop(self) -> None:
        """Puts the previous handlers back."""
        self.watcher.uninstall()

    def at_batch_end(self, worker: int) -> signal.Signals | None:
        """The signal to back up and stop for at this batch end, if any."""
        self._batch_ends += 1
        watcher = self.watcher
        signalled = watcher.received is not None and not watcher.handled
        if self._notice is None:  # One process: stop at once.
            return watcher.received if signalled else None
        if self._stop_at is None:
            if signalled:
                self._stop_at = self._notice.publish(
                    self._batch_ends + 1, watcher.received, worker
                )
            else:
                self._stop_at = self._notice.read()
        if self._stop_at and self._batch_ends >= self._stop_at["batch_end"]:
            return signal.Signals[self._stop_at["signal"]]
        return None

    def pending_alone(self) -> signal.Signals | None:
        """In a training of one process, the signal received and not yet
        acted on, if any (a cluster stops at a batch end all agree on)."""
        watcher = self.watcher
        if (
            self._notice is None
            and watcher.received is not None
            and not watcher.handled
        ):
            return watcher.received
        return None

    def report(self, signum: signal.Signals, saved: str) -> str:
        """Marks the stop done; returns the line that says so. Warns if the
        final backup took longer than the grace period."""
        watcher = self.watcher
        watcher.done()
        name = signum.name
        if watcher.received is None:  # Another worker got the signal.
            name = f"{name} (worker {self._stop_at['worker']})"
        seconds = watcher.seconds_since_signal if watcher.received else 0.0
        if seconds > watcher.grace_period:
            events.warn(
                "preemption",
                f"BackupAndRestore: the final backup took {seconds:.1f} s, more "
                f"than the grace period of {watcher.grace_period:g} s.",
                stacklevel=3,
            )
        again = (
            "run the cell again"
            if interrupted_interactively(signum)
            else "run the same script again"
        )
        return (
            f"BackupAndRestore: received {name}; {saved} {seconds:.1f} s after "
            f"the signal. Stopping training; {again} to resume at this step."
        )
