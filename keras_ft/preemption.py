"""Preemption: turn SIGTERM/SIGINT into "save now and stop".

Cloud VMs are preempted with a SIGTERM and a grace period (30 s on GCP, 2 min
notice on AWS spot). `PreemptionWatcher` records the signal; the callback
saves at the next batch end and stops `fit()`. A handler installed before is
still called (after ours); the old handlers are put back at train end. If no
batch end comes within the grace period (training hung, or ended by an
exception without reaching train end), the process exits as the signal would
have made it, rather than ignore it. A second signal of the same kind while
the first is pending is delivered to the old handler at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any


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

    def install(self) -> bool:
        """Installs the handlers; only possible from the main thread."""
        self.received, self.handled = None, False
        if not self.signals:
            return False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "BackupAndRestore: fit() is not running in the main thread, so "
                "it cannot handle preemption signals; a SIGTERM will end "
                "training without a final backup.",
                stacklevel=3,
            )
            return False
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    def uninstall(self) -> None:
        """Puts the previous handlers back (main thread only)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous = {}

    def done(self) -> None:
        """The requested save happened: the fallback exit is no longer needed."""
        self.handled = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def seconds_since_signal(self) -> float:
        return time.monotonic() - self.received_at

    def _handle(self, signum: int, frame: Any) -> None:
        signum = signal.Signals(signum)
        if self.received is not None:
            # A second signal while we are still saving: the user insists.
            previous = self._previous.get(signum, signal.SIG_DFL)
            self.uninstall()
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self.received, self.received_at = signum, time.monotonic()
        self._timer = threading.Timer(self.grace_period, self._too_late)
        self._timer.daemon = True
        self._timer.start()
        previous = self._previous.get(signum)
        # Python's own SIGINT handler raises KeyboardInterrupt mid-step, which
        # is exactly what we are preventing; any other handler is chained.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def _too_late(self) -> None:
        if not self.handled and self.received is not None:
            print(
                f"BackupAndRestore: no batch ended within the grace period "
                f"({self.grace_period:g} s) after {self.received.name}; exiting "
                "without a final backup. The last committed backup is intact.",
                flush=True,
            )
            os._exit(128 + int(self.received))
