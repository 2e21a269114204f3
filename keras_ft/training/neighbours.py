"""Keras' stock callbacks beside the backup, across a resume.

A resumed `fit()` is the uninterrupted one only if the callbacks beside
`BackupAndRestore` come back as they were too. `callback_state` saves the
attributes in which they count and remember; this module does what an
attribute cannot:

- Every callback: the batches skipped at a resume (trained before the
  restart) are hidden from them (`HiddenBatches`): a callback that counts,
  logs or saves per batch would see them twice, with the backup's logs.
- `LearningRateScheduler`, or any callback that sets the learning rate at an
  epoch's begin: an epoch resumed part-way trains at the backup's rate, not
  at the schedule applied to that rate once more (`RestoredRates`).
- `CSVLogger`: the rows it wrote up to the backup are its state; a resume
  writes them back, whatever `append` says, dropping the killed run's rows
  past the backup (`csv_state()`).
- `TensorBoard`: a `SessionLog` START event at the resumed step makes
  TensorBoard drop the steps the killed run wrote past the backup, as
  `tf.train.Supervisor` wrote on recovery (`restart_tensorboards()`).
- `SwapEMAWeights`: a backup never holds the moving averages swapped in
  (`training_weights()`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_ft import compat, events

# ---------------------------------------------------------------------------
# Batches skipped at a resume.


class HiddenBatches:
    """Keeps the batches skipped at a resume from every callback but one.

    Keras' loop calls `on_train_batch_begin` / `_end` for every step, the
    skipped ones too; while `hidden()` says the next step is skipped, only
    `begin` and `end` (the backup's own handling: preemption, the stall
    deadline) hear of it. Installed on the fit's `CallbackList` instance;
    `remove()` gives it back its own methods.

    Args:
        callback_list: The fit's `CallbackList`.
        begin: Called for a skipped batch's begin, `(batch, logs)`.
        end: Called for a skipped batch's end, `(batch, logs)`.
        hidden: Whether the step about to run is a skipped one.
    """

    def __init__(
        self,
        callback_list: keras.callbacks.CallbackList,
        begin: Callable[[int, dict | None], None],
        end: Callable[[int, dict | None], None],
        hidden: Callable[[], bool],
    ):
        self._list, self._hidden = callback_list, hidden
        self._begin_hidden, self._end_hidden = begin, end
        self._in_hidden_batch = False
        callback_list.on_train_batch_begin = self._begin
        callback_list.on_train_batch_end = self._end

    def _begin(self, batch: int, logs: dict | None = None) -> None:
        if self._hidden():
            self._in_hidden_batch = True
            self._begin_hidden(batch, logs)
            return
        type(self._list).on_train_batch_begin(self._list, batch, logs)

    def _end(self, batch: int, logs: dict | None = None) -> None:
        if self._in_hidden_batch:
            self._in_hidden_batch = False
            self._end_hidden(batch, logs)
            return
        type(self._list).on_train_batch_end(self._list, batch, logs)

    def remove(self) -> None:
        for name in ("on_train_batch_begin", "on_train_batch_end"):
            vars(self._list).pop(name, None)


# ---------------------------------------------------------------------------
# The learning rate of an epoch resumed part-way.


def _optimizers(model: keras.Model) -> list:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optimizers", None)  # A multi-optimizer.
    return [optimizer, *inner] if isinstance(inner, (list, tuple)) else [optimizer]


def _rate(optimizer: Any) -> float | None:
    try:
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except (AttributeError, TypeError, ValueError):
        return None


class RestoredRates:
    """The learning rates a backup restored, for an epoch resumed part-way.

    The backup was taken after that epoch's `on_epoch_begin`, where a
    scheduler had set the epoch's rate; the resumed `fit()` runs the
    scheduler again, on that rate. At the first batch of the resumed epoch
    (every `on_epoch_begin` has run) the rates go back to the backup's.

    Args:
        model: The model, its optimizer restored.
    """

    def __init__(self, model: keras.Model):
        self._rates = [(o, _rate(o)) for o in _optimizers(model)]

    def put_back(self) -> None:
        for optimizer, rate in self._rates:
            now = _rate(optimizer)
            if rate is None or now is None or now == rate:
                continue
            # A rate from a LearningRateSchedule cannot be set (and no
            # scheduler callback could have changed it).
            with contextlib.suppress(TypeError, AttributeError, ValueError):
                optimizer.learning_rate = rate
        self._rates = []


# ---------------------------------------------------------------------------
# CSVLogger's rows.


def csv_state(logger: keras.callbacks.CSVLogger) -> dict[str, str]:
    """The rows `logger` has written: its file's text (it flushes each row)."""
    try:
        with open(logger.filename, encoding="utf-8", newline="") as f:
            return {"rows": f.read()}
    except (OSError, TypeError, UnicodeDecodeError):
        return {}


def set_csv_state(logger: keras.callbacks.CSVLogger, state: dict) -> None:
    """Puts the saved rows back in `logger`'s file and has it append after
    them: the epochs before the resume are there once, whatever `append`
    says, and no row the killed run wrote past the backup."""
    rows = state.get("rows")
    if not isinstance(rows, str):
        return
    csv_file = getattr(logger, "csv_file", None)
    if csv_file is not None and not csv_file.closed:
        csv_file.close()  # Opened by its on_train_begin, maybe truncated.
    try:
        with open(logger.filename, "w", encoding="utf-8", newline="") as f:
            f.write(rows)
        logger.csv_file = open(logger.filename, "a", encoding="utf-8", newline="")  # noqa: SIM115
    except OSError as e:
        events.warn(
            "restore",
            f"BackupAndRestore: CSVLogger's {logger.filename} could not be "
            f"rewritten ({e}); it holds only the epochs run from now on.",
        )
        return
    logger.writer, logger.keys = None, None
    logger.append_header = not rows


# ---------------------------------------------------------------------------
# TensorBoard's steps past the backup.

_EVENTS_NAME = re.compile(r"events\.out\.tfevents\.(\d+)(\.|$)")  # Ours end there.


def restart_tensorboards(
    callbacks: list, point: Any, began: float, unsaved: list
) -> None:
    """Writes a `SessionLog` START event where each `TensorBoard` of
    `callbacks` resumes, so that TensorBoard drops what the killed run
    wrote past the backup.

    TensorBoard's reader purges every value at or past a START's step that
    it read before it (files in name order): the event goes in a file of
    its own, named to sort after the killed run's files and before those
    of this fit (`began`: its train begin, wall clock). The training
    directory counts steps in batches where `update_freq` is not
    `"epoch"`, else in epochs; the validation directory counts its epoch
    values in epochs (its `evaluation_*_vs_iterations` values, in optimizer
    steps, are written again after the START).

    Args:
        callbacks: The fit's other callbacks (their state restored).
        point: The `ResumePoint` resumed from.
        began: When this fit()'s train begin ran (`time.time()`).
        unsaved: The `TensorBoard`s of `callbacks` whose state the backup
            does not hold.
    """
    boards = [c for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)]
    for board in unsaved:
        # One the backup does not know (added since): its steps go on
        # from the optimizer's, as one that ran from the start would.
        compat.set_tensorboard_batches(board, point.step)
    if not boards or not compat.usable("tensorboard_events"):
        return
    epoch = point.epoch
    for board in boards:
        train, validation = compat.tensorboard_dirs(board)
        batches = getattr(board, "update_freq", "epoch") != "epoch"
        counted = compat.tensorboard_batches(board)
        step = counted + 1 if batches and counted is not None else epoch
        try:
            _write_start(train, step, began, keep=None)
            # Optimizer steps at or before the backup's, read again.
            _write_start(validation, epoch, began, keep=point.step)
        except Exception as e:  # A log is not worth stopping a training for.
            compat.fail("tensorboard_events", e)


def _write_start(directory: str, step: int, began: float, keep: int | None) -> None:
    if not os.path.isdir(directory):
        return  # Nothing written there before: nothing to drop.
    names = sorted(n for n in os.listdir(directory) if _EVENTS_NAME.match(n))
    own = f".{os.getpid()}."
    old, current = [], []
    for name in names:
        stamp = int(_EVENTS_NAME.match(name).group(1))
        mine = own in name and socket.gethostname() in name
        (current if mine and stamp >= math.floor(began) - 1 else old).append(name)
    if not old:
        return
    # A prefix of this fit's first file sorts before it, and after every
    # file of an earlier second; with none yet, this second's prefix.
    if current:
        stamp = _EVENTS_NAME.match(current[0]).group(1)
    else:
        stamp = f"{int(time.time()):010d}"  # Floored, as TensorFlow names files.
    path = os.path.join(directory, f"events.out.tfevents.{stamp}")
    kept = []
    if keep is not None:
        kept = [
            e
            for e in compat.read_events(os.path.join(directory, n) for n in old)
            if step <= e.step <= keep and _in_steps(e)
        ]
    compat.write_restart(path, step, kept)


def _in_steps(event: Any) -> bool:
    """Whether a validation event counts optimizer steps (not epochs)."""
    values = getattr(getattr(event, "summary", None), "value", [])
    return bool(values) and all(v.tag.endswith("_vs_iterations") for v in values)


# ---------------------------------------------------------------------------
# Weights swapped in for evaluation.


@contextlib.contextmanager
def training_weights(callbacks: list) -> Iterator[None]:
    """While inside, the model holds its training weights: a `SwapEMAWeights`
    that has the moving averages swapped in has them swapped out, then in
    again. A backup taken inside never holds swapped-in weights."""
    swapped = compat.swapped_in(callbacks)
    for callback in swapped:
        compat.swap_ema(callback)
    try:
        yield
    finally:
        for callback in reversed(swapped):
            compat.swap_ema(callback)
