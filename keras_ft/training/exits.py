"""A lost peer ends the process with the retryable exit status.

When a peer of a cluster dies, the survivors' next collective fails with
the framework's own error: TensorFlow's `UnavailableError` ("the following
tasks are unhealthy") once its coordination service misses the peer's
heartbeats, JAX's runtime error from gloo ("Connection reset by peer") at
once. Left alone, that error ends the process with status 1, which a
scheduler must read as a bug (do not retry), and JAX then waits in its
shutdown barrier for the dead peer until its coordination service aborts
the process. A lost peer is a failure of the job, not of the user's code:
`exit_retryably_on_lost_peer()` makes such an uncaught error end the process
with `RETRYABLE_EXIT_CODE` (75) right after its traceback is printed,
without waiting for the dead peer in the shutdown barrier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from types import TracebackType

from keras_ft import events
from keras_ft.training.watchdog import RETRYABLE_EXIT_CODE

__all__ = ["exit_retryably_on_lost_peer", "lost_peer"]

# TensorFlow's errors for a peer that stopped answering (collectives report a
# missed heartbeat as UnavailableError; an RPC past its deadline as
# DeadlineExceededError).
_TF_ERRORS = ("UnavailableError", "DeadlineExceededError")
# JAX raises one runtime error type for everything; its status and the
# transport's text say when the failure was a peer's.
_JAX_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")
_JAX_MARKERS = (
    "UNAVAILABLE:",
    "DEADLINE_EXCEEDED:",
    "Gloo",
    "heartbeat timeout",
    "Connection reset by peer",
    "Connection refused",
)


def lost_peer(error: BaseException | None) -> str | None:
    """What in `error` (or an error it was raised from) says a peer of the
    cluster is gone, or `None` when nothing does."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        kind = type(error)
        text = str(error)
        if kind.__module__.startswith("tensorflow") and kind.__name__ in _TF_ERRORS:
            return f"TensorFlow's {kind.__name__}"
        if kind.__name__ in _JAX_ERRORS and any(m in text for m in _JAX_MARKERS):
            first = text.strip().splitlines()[0] if text.strip() else ""
            return f"JAX's {kind.__name__} ({first[:160]})"
        error = error.__cause__ or error.__context__
    return None


def _hook(
    kind: type[BaseException],
    value: BaseException,
    traceback: TracebackType | None,
    previous=None,
) -> None:
    (previous or sys.__excepthook__)(kind, value, traceback)
    why = lost_peer(value)
    if why is None:
        return
    events.say(
        "cluster",
        f"keras-ft: {why} says a peer of this cluster is gone. Exiting with "
        f"status {RETRYABLE_EXIT_CODE} (retryable) without waiting for it in "
        "the framework's shutdown barrier; relaunch the job (torchrun "
        "--max-restarts, a Kubernetes podFailurePolicy, SLURM --requeue) and "
        "it resumes from its last backup.",
        level=logging.ERROR,
        write=lambda line: sys.stderr.write(line + "\n"),
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(RETRYABLE_EXIT_CODE)


def exit_retryably_on_lost_peer() -> None:
    """Chains `sys.excepthook` (once per process): an uncaught error that
    `lost_peer()` recognizes ends the process with `RETRYABLE_EXIT_CODE`
    after the usual traceback. Any other error is reported as before; an
    error the script catches is never seen here."""
    current = sys.excepthook
    if getattr(current, "_keras_ft_lost_peer", False):
        return

    def hook(kind, value, traceback) -> None:
        _hook(kind, value, traceback, previous=current)

    hook._keras_ft_lost_peer = True  # type: ignore[attr-defined]
    sys.excepthook = hook
