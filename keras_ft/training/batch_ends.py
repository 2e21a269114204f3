"""Where a training batch's end is handled: at Keras' batch end, or at the
next batch's begin.

Before it calls a batch end that a callback overrides, Keras turns the step's
logs into numbers, which waits for the step to finish on the device, unless
every callback says it is `async_safe`: then Keras calls the batch ends on a
thread of its own and goes on dispatching steps. On an accelerator, that wait
at every batch keeps the host from running ahead of the device.

`BackupAndRestore` says it is async-safe on JAX and PyTorch. Its batch end
then only notes the batch (`BatchEnds.note`). The work of that batch's end
(the schedule, a save, a preemption stop) runs at the next batch's begin,
which Keras always calls on the training thread, with the state as the batch
left it. The epoch's last batch is handled at the epoch's end: Keras has run
every batch end by then. Where Keras calls the batch end on the training
thread (another callback is not async-safe, or the backend is not
thread-safe), it is handled there, as before.

On PyTorch, `fit()`'s loop draws the next batch before that batch's begin:
what a backup notes of the input stays right (a `PyDataset`'s generators are
kept per load, before each; arrays replay their epoch's order). TensorFlow's
Keras never calls a batch end off the training thread.
"""

from __future__ import annotations

import threading
from typing import Any

import keras

from keras_ft.training.resume import FastForward


def deferrable() -> bool:
    """Whether `BackupAndRestore` lets Keras call its batch end off the
    training thread (its `async_safe`)."""
    return keras.backend.backend() in ("jax", "torch")


class BatchEnds:
    """Batch ends Keras called on its callback thread, for the training
    thread to handle."""

    def __init__(self) -> None:
        self._thread: int | None = None
        self._noted: tuple[int, dict | None] | None = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> BatchEnds:
        # Keras Tuner deep-copies the callbacks for each trial; a lock cannot
        # be copied, and nothing noted outlives a fit().
        return BatchEnds()

    def start(self) -> None:
        """At train begin, on the training thread."""
        self._thread = threading.get_ident()
        self._noted = None

    def epoch_begin(self) -> None:
        self._noted = None

    def here(self) -> bool:
        """Whether this call is on the training thread (or outside `fit()`)."""
        return self._thread is None or threading.get_ident() == self._thread

    def note(self, done: int, logs: dict | None) -> None:
        """A batch end on Keras' callback thread: `done` batches into the
        epoch, with its logs (numbers by now). Keras' pool has several
        threads, so batch ends may finish out of order: the latest stays."""
        with self._lock:
            if self._noted is None or done > self._noted[0]:
                self._noted = (done, logs)

    def unhandled(self, handled: int) -> tuple[int, dict | None] | None:
        """At the epoch's end: the last batch end noted, if it is past the
        `handled` batches."""
        noted = self._noted
        if noted is not None and noted[0] > handled:
            return noted
        return None

    def logs(self, done: int, model: keras.Model, given: dict | None) -> dict[str, Any]:
        """The logs after `done` batches, for a save: those Keras `given`
        with the batch end, if it was on the training thread; else as noted
        if the callback thread has got there, else the model's metrics now
        (what Keras' batch logs are made of)."""
        if given is not None:
            return given
        noted = self._noted
        if noted is not None and noted[0] == done and noted[1] is not None:
            return noted[1]
        try:
            result = model.get_metrics_result()
        except Exception:  # A model whose metrics cannot be read: no logs.
            return {}
        return numbers(result)


def numbers(logs: dict | None) -> dict[str, float]:
    """The entries of `logs` that are numbers (Python, NumPy or backend
    scalars), as floats; the rest left out."""
    result = {}
    for key, value in (logs or {}).items():
        try:
            result[key] = float(keras.ops.convert_to_numpy(value))
        except (TypeError, ValueError):
            continue
    return result


def skip_next_step(model: keras.Model, logs: dict) -> None:
    """Makes the step Keras runs after this batch begin a no-op that draws
    nothing: a preemption stop asked for at a batch begin ends `fit()` with
    the model as backed up, one step before Keras' loop sees the stop."""
    steps = getattr(model, "steps_per_execution", 1) or 1
    FastForward(model, steps, logs, on_done=lambda: None, at_source=lambda _: True)
