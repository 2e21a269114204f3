"""Resuming inside `fit()`: skip what was trained, restore what was reset.

`fit()` restarts an epoch at its first batch. To continue at batch `k`, the
model's `train_function` is replaced for the first `k` steps by one that does
not run the model, then hands back the real one (`fit_loop.skipped_step()`
knows how each backend's `fit()` loop calls `train_function`). Where the input
can skip the trained batches itself (`inputs.py`: a `PyDataset`, a `tf.data`
iterator restored), the skipped steps pull nothing; otherwise each takes its
batch from the pipeline, so that the pipeline, its shuffling and its random
draws advance exactly as before.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import keras

from keras_ft import compat, events
from keras_ft.backend import fit_loop
from keras_ft.state import ResumePoint, rng
from keras_ft.state.training_state import set_rnn_states
from keras_ft.training import callback_state, neighbours
from keras_ft.training.inputs import InputPosition


class FastForward:
    """Makes a model's next `steps` training steps no-ops that consume data.

    Args:
        model: The model being fitted; `make_train_function()` must have run.
        steps: Number of steps to skip.
        logs: The logs reported for each skipped step.
        on_done: Called once the last skipped step has been consumed.
        on_first_batch: Called with the first skipped batch, when the data
            pipeline hands it to `train_function` (TensorFlow, JAX); with
            the iterator's `element_spec` (or `None`) if nothing is pulled.
        at_source: Called with the iterator at the first skipped step;
            returns whether the input skips the trained batches itself (then
            the skipped steps pull nothing through the pipeline).
    """

    def __init__(
        self,
        model: keras.Model,
        steps: int,
        logs: dict[str, float],
        on_done: Callable[[], None],
        on_first_batch: Callable[[Any], None] | None = None,
        at_source: Callable[[Any], bool] | None = None,
    ):
        self.model = model
        self.at_source = at_source
        self.pulls = True
        self.steps_per_execution = getattr(model, "steps_per_execution", 1) or 1
        self.remaining = steps
        self.logs = dict(logs)
        self.on_done = on_done
        self.on_first_batch = on_first_batch
        self.original = model.train_function
        model.train_function = self._skip

    @property
    def active(self) -> bool:
        return self.model.train_function == self._skip

    def remove(self) -> None:
        """Gives the model its real `train_function` back."""
        if self.active:
            self.model.train_function = self.original

    def _skip(self, *args: Any) -> Any:
        if self.at_source is not None:
            at_source, self.at_source = self.at_source, None
            self.pulls = not at_source(fit_loop.step_iterator(args))
        self.remaining -= self.steps_per_execution
        result, batches, iterator = fit_loop.skipped_step(
            args, self.logs, self.steps_per_execution, pull=self.pulls
        )
        if not self.pulls and self.on_first_batch is not None:
            first, self.on_first_batch = self.on_first_batch, None
            first(getattr(iterator, "element_spec", None))
        if batches and self.on_first_batch is not None:
            first, self.on_first_batch = self.on_first_batch, None
            first(batches[0])
        if self.remaining <= 0:
            self.remove()
            self.on_done()
        return result


def skipping(model: keras.Model) -> bool:
    """Whether the model's next training step is skipped (`FastForward`)."""
    return isinstance(getattr(model.train_function, "__self__", None), FastForward)


class Resumption:
    """Carries a restored training state through the `fit()` that resumes it.

    At each epoch begin it says how many of the epoch's batches were trained
    before the restart and sets up skipping them: the rest of the
    interrupted epoch (`FastForward`, with the random state and metrics of
    the save), or whole epochs where this Keras' `fit()` does not start at
    the resume epoch. At the resume epoch it gives the other callbacks their
    saved state (their `on_train_begin` has reset it by then).

    Args:
        model: The model being fitted.
        point: Where training resumes.
        apply_metrics: Sets the model's metric variables to saved values;
            returns whether they matched.
        jumped: Whether `fit()` starts at `point.epoch`; if not, the
            completed epochs before it are read through without training.
        inputs: The input `fit()` reads, if it can skip trained items.
        began: When the fit() began (`time.time()`): another callback's
            TensorBoard files from then on are this fit's. Defaults to now.
    """

    def __init__(
        self,
        model: keras.Model,
        point: ResumePoint,
        apply_metrics: Callable[[list], bool],
        jumped: bool,
        inputs: InputPosition | None = None,
        began: float | None = None,
    ):
        self.model = model
        self.inputs = inputs
        self.point = point
        self.apply_metrics = apply_metrics
        self.skip_epochs_before = 0 if jumped else point.epoch
        self.started = False  # The resume epoch has begun.
        self._fast_forward: FastForward | None = None
        self._began = time.time() if began is None else began
        self._hidden: neighbours.HiddenBatches | None = None
        # An epoch resumed part-way trains at the backup's learning rate.
        self._rates = neighbours.RestoredRates(model) if point.batch else None
        # The training steps' generators, when the resumed epoch trains no
        # batch (saved at its end, in validation): put back as its training
        # ends, past Keras' drawing of the next epoch's iterator.
        self._model_rng: dict | None = None
        # The generators a resume sets as noted at the save (`None`: all).
        self._set_up_to: tuple[str, ...] | None = None

    def hide_skipped_batches(
        self,
        callback_list: keras.callbacks.CallbackList | None,
        begin: Callable[[int, dict | None], None],
        end: Callable[[int, dict | None], None],
    ) -> None:
        """Keeps the skipped batches (trained before the restart) from
        every callback in `callback_list`: only `begin` and `end` (the
        backup's own handling) hear of them."""
        if callback_list is not None:
            model = self.model
            self._hidden = neighbours.HiddenBatches(
                callback_list, begin, end, lambda: skipping(model)
            )

    def batch_begin(self) -> None:
        """At a batch's begin, every callback's `on_epoch_begin` run."""
        if self._rates is not None and self.started:
            self._rates.put_back()
            self._rates = None
        if self._hidden is not None and self.started and not skipping(self.model):
            # Every skipped batch is behind: the list gets its own hooks back.
            self._hidden.remove()
            self._hidden = None

    def skips_epoch(self, epoch: int) -> bool:
        """Whether `epoch` is one completed before the restart, read through."""
        return epoch < self.skip_epochs_before

    def begin_epoch(self, epoch: int, steps: int | None, callbacks: list) -> int:
        """Sets up `epoch`; returns how many of its batches are skipped."""
        self.remove()
        point = self.point
        if self.skips_epoch(epoch):
            steps = steps or sys.maxsize
            self._fast_forward = FastForward(
                self.model, steps, point.extra.get("logs", {}), on_done=_nothing
            )
            return steps
        if self.started:
            return 0
        self.started = True
        if self.inputs is not None:
            # Before anything of the epoch is loaded.
            self.inputs.set_dataset_state(point)
            # Before the epoch's random state is put back: the stream's
            # earlier batches are drawn from a state of their own, and leave
            # the data side's generators where they drew them to.
            if self.inputs.advance_stream(point):
                self._set_up_to = rng.model_side()
        if self.skip_epochs_before and not point.batch:
            # The epochs read through drew from the generators: the next
            # epoch begins with them as they were at the save.
            rng.apply(point.extra.get("rng", {}), only=self._set_up_to)
        # Every other callback's on_train_begin has reset it by now (and
        # their epoch ends of epochs skipped since are undone).
        callback_state.apply(callbacks, point.extra.get("callbacks", {}))
        if point.batch and epoch == point.epoch:
            callback_state.catch_up(
                callbacks, point.extra.get("callbacks_behind", []), point.batch
            )
        _warn_if_callbacks_pending(point)
        saved = point.extra.get("callbacks", {})
        unsaved = [
            c
            for key, c in callback_state.keyed(callbacks)
            if isinstance(c, keras.callbacks.TensorBoard) and key not in saved
        ]
        neighbours.restart_tensorboards(callbacks, point, self._began, unsaved)
        if point.batch and epoch == point.epoch:
            self._continue_epoch(whole=bool(steps) and point.batch >= steps)
            return point.batch
        return 0

    def remove(self) -> None:
        """Gives the model its real `train_function` back, if skipping."""
        if self._fast_forward is not None:
            self._fast_forward.remove()
            self._fast_forward = None

    def end(self) -> None:
        """At the fit()'s end: nothing of the resume stays in place."""
        self.remove()
        if self._hidden is not None:
            self._hidden.remove()
            self._hidden = None

    def training_over(self) -> None:
        """Where the resumed epoch's training is over (its validation's
        begin, or its end) though none of its batches trained: the training
        steps' generators as its batches left them."""
        if self._model_rng is not None:
            rng.apply(self._model_rng, only=rng.model_side())
            self._model_rng = None

    def _continue_epoch(self, whole: bool) -> None:
        """Sets up the rest of an interrupted epoch to run as it would have;
        `whole`: every batch of it trained before the restart."""
        point, model = self.point, self.model
        extra = point.extra
        if "epoch_begin_rng" in extra:
            # The data pipeline shuffles with these when iteration starts, and
            # replays every later draw as the skipped batches go through it.
            rng.apply(extra["epoch_begin_rng"], only=self._set_up_to)
        # So that the epoch's mean loss and metrics come out as they would
        # have; fit() reset them just before on_epoch_begin.
        metrics = extra.get("metrics", [])
        metrics_set = self.apply_metrics(metrics)

        def first_batch(batch: Any) -> None:
            if metrics_set:
                return
            # TensorFlow builds compiled metrics inside the first step; build
            # them now, from the batch (or its spec) in hand, to give them
            # their values.
            if batch is not None and not compat.is_placeholder(batch):
                compat.build_metrics(model, batch)
            if not self.apply_metrics(metrics):
                events.warn(
                    "restore",
                    f"BackupAndRestore: the backup holds {len(metrics)} metric "
                    f"variables, the model {len(model.metrics_variables)}; the "
                    "metrics of the resumed epoch start afresh.",
                    stacklevel=2,
                )

        def skipped_all() -> None:
            # The skipped batches went through the same pipeline and callbacks
            # as before and replayed their draws since the epoch began, maybe
            # on a prefetching thread that a reset now would race with. The
            # training steps did not run: their generators jump to the save.
            self._fast_forward = None
            # Where the epoch's callbacks (`on_epoch_begin`) may have reset them.
            set_rnn_states(model, extra.get("rnn_states", []))
            if whole:  # Keras draws the next epoch's iterator first (PyTorch).
                self._model_rng = extra.get("rng", {})
            else:
                rng.apply(extra.get("rng", {}), only=rng.model_side())

        # Where the input allows it, the trained batches are not loaded at
        # all: the skipped steps then pull nothing.
        inputs = self.inputs
        skipping = inputs is not None and inputs.skip(point)

        def at_source(iterator: Any) -> bool:
            if inputs is None:
                return False
            if skipping or inputs.restore_iterator(point, iterator):
                return True
            inputs.replaying(point.batch)
            return False

        self._fast_forward = FastForward(
            model,
            point.batch,
            extra.get("logs", {}),
            on_done=skipped_all,
            on_first_batch=first_batch,
            at_source=at_source,
        )


def check_saved(extra: dict, callbacks: list) -> None:
    """Raises `ValueError` unless what `BackupAndRestore` saved beside the
    variables has the shape a resume uses, beyond what the restore checks
    of any checkpoint (`saved_state.check()`): the generator states of the
    epoch's and the stream's begin (PyTorch's and Keras' too), and this
    fit()'s stock callbacks' state by what each callback is. Checked before
    anything is restored, so that a malformed checkpoint is damage (the
    restore falls back) rather than an error mid-training.

    Args:
        extra: A checkpoint's `ResumePoint.extra`.
        callbacks: This fit()'s other callbacks.
    """
    rng.check(extra.get("epoch_begin_rng", {}))
    saved_input = extra.get("input", {})
    if isinstance(saved_input, dict):  # A stream's, PyTorch's included.
        rng.check(saved_input.get("stream_rng", {}))
    callback_state.check(callbacks, extra.get("callbacks", {}))
    drawn = extra.get("validation_drawn", 0)
    if type(drawn) is not int or drawn < 0:
        raise ValueError(f"validation_drawn is not a count of batches: {drawn!r}")


def position(point: ResumePoint, params: dict) -> str:
    """Where a resumed fit() continues, as the restore line says it."""
    epoch = f"epoch {point.epoch + 1}/{params.get('epochs', '?')}"
    steps = params.get("steps")
    if steps and point.batch >= steps:
        # Saved after the epoch's last batch, before its on_epoch_end ran.
        return f"the end of {epoch}"
    if point.batch:
        return f"{epoch}, batch {point.batch + 1}"
    return epoch


def _warn_if_callbacks_pending(point: ResumePoint) -> None:
    pending = point.extra.get("callbacks_pending")
    if pending:
        events.warn(
            "restore",
            f"BackupAndRestore: {point.checkpoint} was backed up before the "
            f"on_epoch_end of {', '.join(pending)} ran (training stopped "
            "there, e.g. a later callback raised). Their state is restored as "
            f"it was before the end of epoch {point.epoch}.",
            stacklevel=4,
        )


def _nothing() -> None:
    pass
