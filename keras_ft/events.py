"""keras-ft's events, on Python's `logging`: where a user routes or silences them.

Every event goes to a logger named `keras_ft.<kind>` (kinds below), at a
level that says how much it matters. The lines `verbose=1` prints stay as
Keras prints its own (whole lines on standard output, no prefix), and the
warnings stay Python warnings, until the user takes the events over:

- A handler attached to `logging.getLogger("keras_ft")` (or to one kind's
  logger) receives the events, and the lines and warnings it takes are no
  longer printed or raised: nothing is written twice.
- `logging.getLogger("keras_ft.save").setLevel(logging.WARNING)` silences
  one kind, its printed lines and warnings included.
- The events below `WARNING` (a restore, a save committed) are logged where
  a level of `INFO` or below is set: `logging.getLogger("keras_ft")
  .setLevel(logging.INFO)`, as for any library.

The records also reach the root logger, as any library's do: a root handler
that writes to the console shows a line `verbose=1` printed too (pass
`verbose=0`, or attach the handler to `keras_ft`). Handlers on the root
logger do not stop the printed lines: TensorFlow, absl and pytest attach
their own there.

Keras-free, and imports nothing of keras-ft: every layer may tell.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

ROOT = "keras_ft"
# The kinds of event, each a logger of its own under `keras_ft`.
KINDS = (
    "restore",  # A backup restored, or none to restore; a fallback on restore.
    "save",  # A save committed, skipped, or refused; upload progress.
    "fallback",  # A faster path left for a slower one that keeps the backup.
    "lease",  # The bucket's writer lease: taken, renewed, lost.
    "preemption",  # A signal, the final save, the exit.
    "stall",  # The step deadline: a stuck training ended.
    "tier",  # The local tier in front of a bucket.
    "stop",  # Stops at a step or a time budget; the NaN guard.
    "cluster",  # Workers, launchers, the cluster's heartbeat.
    "compat",  # A private Keras, TensorFlow or JAX name that moved.
    "goodput",  # A finished run's goodput, at train end, before its backup goes.
)

logging.getLogger(ROOT).addHandler(logging.NullHandler())
# Seconds a transfer lasts before its progress line shows (`Progress`).
PROGRESS_AFTER = 2.0


def logger(kind: str) -> logging.Logger:
    """The logger of one kind of event, `keras_ft.<kind>`."""
    if kind not in KINDS:
        raise ValueError(f"Unknown keras-ft event kind {kind!r}; one of {KINDS}.")
    return logging.getLogger(f"{ROOT}.{kind}")


def log(kind: str, message: str, level: int = logging.INFO) -> None:
    """An event no line is printed for (a save committed, a lease renewed)."""
    logger(kind).log(level, message)


def say(
    kind: str,
    message: str,
    *,
    verbose: bool = True,
    level: int = logging.INFO,
    write: Callable[[str], None] | None = None,
) -> None:
    """An event a user sees with `verbose`: logged, and printed as a whole
    line by `write` (one write to standard output by default) unless a
    handler attached to keras-ft's loggers took it or its kind is silenced."""
    named = logger(kind)
    if silenced(named, level):
        return
    named.log(level, message)
    if verbose and not routed(named, level):
        (write or _write_line)(message)


# What was said or done once per process (`first_time()`): a notice that
# does not change between trainings would only repeat itself at every fit(),
# and a process's clean-up of dead processes' leftovers is done once.
_said: set[tuple[str, str]] = set()


def first_time(kind: str, key: str) -> bool:
    """Whether the once-per-process notice (or deed) `key` of `kind` is
    said now: `True` once, `False` after. A caller that makes a notice moot
    calls it without saying anything."""
    if (kind, key) in _said:
        return False
    _said.add((kind, key))
    return True


def warn(
    kind: str,
    message: str,
    category: type[Warning] = UserWarning,
    stacklevel: int = 1,
) -> None:
    """A warning: logged at `WARNING`, and raised as a Python warning (for
    `warnings` filters, and pytest) unless a handler attached to keras-ft's
    loggers took it or its kind is silenced. `stacklevel` is as
    `warnings.warn()`'s, counted from the caller."""
    named = logger(kind)
    if silenced(named, logging.WARNING):
        return
    named.warning(message)
    if not routed(named, logging.WARNING):
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def silenced(named: logging.Logger, level: int) -> bool:
    """Whether the user set a level above `level` on `named` or a logger
    above it, up to `keras_ft` (the root's level does not silence a line)."""
    for current in _ours(named):
        if current.level != logging.NOTSET:
            return level < current.level
    return False


def routed(named: logging.Logger, level: int) -> bool:
    """Whether a handler the user attached to `named` or a logger above it,
    up to `keras_ft` (not the root), takes a record of `level`."""
    if not named.isEnabledFor(level):
        return False  # Not logged (the level in effect is the root's).
    for current in _ours(named):
        for handler in current.handlers:
            if not isinstance(handler, logging.NullHandler) and level >= handler.level:
                return True
    return False


def _ours(named: logging.Logger) -> list[logging.Logger]:
    """`named` and the loggers above it up to `keras_ft`, as far as records
    propagate."""
    chain = []
    current: logging.Logger | None = named
    while current is not None and (
        current.name == ROOT or current.name.startswith(ROOT + ".")
    ):
        chain.append(current)
        if not current.propagate:
            break
        current = current.parent
    return chain


def _write_line(line: str) -> None:
    # One write: from a background thread, a line must not run into one the
    # training thread prints at the same time (print() writes the text and
    # the newline separately).
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Progress:
    """A long transfer's bytes and rate, shown as Keras' `Progbar` shows an
    epoch: one line redrawn in place, on a terminal or in a notebook, once
    the transfer has lasted `after` seconds. Where the output is not a
    terminal (a log file, a job's captured output) nothing is drawn: the
    transfer is logged once, at its end.

    Args:
        kind: The kind of event (`"save"`, `"restore"`).
        what: What moves, for the line (`"uploading ckpt-00000003/model.weights.h5"`).
        total: Its size in bytes.
        after: Seconds before the line first shows. Defaults to
            `PROGRESS_AFTER` (2).
        stream: Where the line is drawn. Defaults to standard output.
    """

    def __init__(
        self,
        kind: str,
        what: str,
        total: int,
        after: float | None = None,
        stream: Any = None,
    ):
        self.kind, self.what, self.total = kind, what, total
        self.after = PROGRESS_AFTER if after is None else after
        self.stream = stream if stream is not None else sys.stdout
        self.started = time.monotonic()
        self.done = 0
        self._drawn = 0.0  # When the line was last drawn (0: never).
        self._width = 0
        self._closed = False
        self._lock = threading.Lock()  # Files move on several threads.

    def add(self, count: int) -> None:
        """`count` more bytes have moved (from any thread); at `total` the
        transfer is over (`close()`)."""
        with self._lock:
            self._update(self.done + count)
            if self.done >= self.total:
                self._close()

    def update(self, done: int) -> None:
        """`done` bytes of `total` have moved."""
        with self._lock:
            self._update(done)

    def _update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if now - self.started < self.after or now - self._drawn < 0.1:
            return
        if not _dynamic(self.stream) or silenced(logger(self.kind), logging.INFO):
            return
        self._draw(now)

    def close(self) -> None:
        """The transfer is over: the line ends (if one was drawn), and the
        transfer is logged. Once: later calls do nothing."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        seconds = time.monotonic() - self.started
        if self._drawn:
            self.done = max(self.done, self.total)
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        log(
            self.kind,
            f"{self.what}: {_megabytes(self.total)} in {seconds:.1f} s "
            f"({_megabytes(self.total / max(seconds, 1e-9))}/s)",
        )

    def _draw(self, now: float) -> None:
        self._drawn = now
        seconds = max(now - self.started, 1e-9)
        share = min(1.0, self.done / max(self.total, 1))
        bar = "=" * int(share * 30)
        if share < 1:
            bar += ">"
        line = (
            f"{self.what} [{bar:<30}] {_megabytes(self.done)}/"
            f"{_megabytes(self.total)} {_megabytes(self.done / seconds)}/s"
        )
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()


def _dynamic(stream: Any) -> bool:
    """Whether `stream` shows a line redrawn in place: a terminal, or a
    notebook's output (Keras' `Progbar` asks the same)."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty is not None and isatty():
            return True
    except ValueError:  # Closed.
        return False
    return "ipykernel" in sys.modules and stream is sys.stdout


def _megabytes(count: float) -> str:
    return f"{count / 2**20:.0f} MB" if count >= 2**20 else f"{count / 1024:.0f} KB"
