"""Where an epoch's input stands: what a backup notes of it, and how a
resumed epoch goes on without loading again what was trained.

NumPy arrays and tensors (on JAX and PyTorch) are sliced by Keras as each
batch is pulled: a resumed epoch pulls its trained batches as placeholders
sliced from nothing (`compat.ArrayView`), so the epoch's order is drawn as
before and no trained row is copied. On TensorFlow, Keras slices arrays
inside a `tf.data` pipeline: replayed.

A `keras.utils.PyDataset` is followed item by item (`compat.PyDatasetView`).
A resumed epoch skips its trained items at the source: Keras' own generator
draws the epoch's order as before and asks for every item, and the trained
ones load nothing, so `__getitem__` runs only for what is left to train.
What loading them would have drawn from Python's and NumPy's global
generators (augmentation in `__getitem__`) is not drawn either: a backup
notes the generators' state just before the first untrained item was loaded,
and the resumed epoch sets it before loading that item. Items load ahead of
training (a prefetching pipeline), so the state of the last few loads is kept
as they happen; a save too far behind the loads (or an older backup) resumes
by replaying the loads instead.

With workers (`PyDataset(workers=...)`), items load in parallel: the skip is
the same, but draws inside `__getitem__` were never in a fixed order, and
processes draw from their own generators, which a resume does not set.

A `tf.data.Dataset` (TensorFlow) is saved as TensorFlow checkpoints its
iterators: the backup holds the iterator's state, its shuffle and prefetch
buffers included, and the resumed epoch's new iterator takes it before it
yields anything. The rest of the epoch, and the order of later epochs of a
pipeline that reshuffles, come out as in an uninterrupted run. A pipeline
with state outside the graph (a `py_function`) cannot be saved: replayed.
On JAX and PyTorch, Keras reads the pipeline through NumPy, so no iterator
state is saved: replayed too. One that reshuffles (`Dataset.shuffle()`)
draws each epoch's order as Keras makes the epoch's iterator (on TensorFlow
also one at each epoch's end, for the next): a backup notes how many Keras
had made, and a resumed process makes as many before its first epoch, so
that epoch draws the order it drew before. A backup from before that count
resumes in another order, with a warning.

Input read with `steps_per_epoch` is one stream across the epochs (a Python
generator, a `tf.data` pipeline, and arrays, a `PyDataset` or a PyTorch
`DataLoader` with more batches than an epoch takes): Keras does not restart
it at an epoch's begin, and one that runs out ends its epoch (counted as
run), then starts again in the next. Its position is counted from the pass's
start (`stream_at()`). A new process makes the pass's iterator where the
uninterrupted run had made it (before the random state put back: on PyTorch
making it draws from the generator training draws from), draws the batches
of the pass before the resumed epoch again (`advance_stream()`) from the
generators as they were when the pass began (what a generator drew from them
comes out the same), and puts them back afterwards; then the resumed epoch
goes on as any other.

A `PyDataset` that keeps state of its own (an order its `on_epoch_end()`
shuffles, say) takes part as a callback does, by defining `get_state()` and
`set_state()`: a backup holds what `get_state()` returns (copied: JSON values
and NumPy arrays), and the resumed epoch calls `set_state()` with it before
anything is loaded. One that changes itself in `on_epoch_end()` or
`on_epoch_begin()` without them is named in a warning at the first save. In
a cluster, only the chief's state is backed up, and every process gets it
back: a state that differs between processes does not resume exactly.

A `tf.data` pipeline whose functions use variables (a Keras random layer in
`map()`, augmenting: its seed generator advances with every batch) cannot be
saved with its iterator: it is replayed. The variables' values when the
epoch began (or, in a stream, its pass) are backed up and set back before
the replay, which advances them as the first run did.

A Grain `MapDataset` or `IterDataset` is saved as Grain checkpoints its
iterators (`compat.GrainView`): the backup holds the state of the epoch's
iterator after the trained batches (JSON, a few bytes), and the resumed
epoch's new iterator takes it before it yields anything, so nothing trained
is loaded again. A state Grain refuses (another pipeline) is replayed, and
so is a `grain.DataLoader` (which Keras rebuilds from its parts).
"""

from __future__ import annotations

import collections
import copy
import json
from typing import Any

import keras
import numpy as np

from keras_ft import compat, events
from keras_ft.backend import fit_loop
from keras_ft.state import ResumePoint, arrays, rng

# The loads before the training position whose random state is kept (of a
# Grain iterator, its state after each batch): a pipeline prefetching
# further ahead than this resumes by replay.
KEPT_LOADS = 64


class InputPosition:
    """The input of one `fit()`, followed as far as it can be.

    Args:
        epoch_iterator: `fit()`'s epoch iterator (`None` outside `fit()`).
    """

    def __init__(self, epoch_iterator: Any):
        self.epoch_iterator = epoch_iterator
        self._loads = 0  # Items of the epoch loaded or skipped so far.
        # A stream read across epochs: batches drawn before this epoch, and
        # the data side's generators when it began.
        self._stream_start: int | None = None
        self._stream_rng: dict[str, Any] | None = None
        # Whether its iterator was made before its first epoch began (at
        # the end of the last pass), before `_stream_rng` was noted.
        self._stream_made = False
        # A tf.data pipeline's variables, and their values when the epoch
        # and the stream's pass began.
        tf_dataset = compat.fit_tf_dataset(epoch_iterator)
        self._variables = compat.tf_dataset_variables(tf_dataset)
        self._epoch_values: list[np.ndarray] | None = None
        self._stream_values: list[np.ndarray] | None = None
        # A tf.data pipeline that reshuffles draws each epoch's order when
        # Keras makes the epoch's iterator; how many it made before this
        # epoch's.
        reshuffles = compat.tf_dataset_reshuffles(tf_dataset)
        self._reshuffling = tf_dataset if reshuffles else None
        self._iterators = -1
        self._caught_up = False  # Its orders drawn as before the restart.
        self._before: collections.deque = collections.deque(maxlen=KEPT_LOADS)
        self._resume_rng: dict[str, Any] | None = None
        # The user's `PyDataset`, before a view stands in for it.
        dataset = compat.py_dataset(epoch_iterator)
        self.dataset = dataset if isinstance(dataset, keras.utils.PyDataset) else None
        self.view = compat.PyDatasetView.of(epoch_iterator, self._before_load)
        self._tf_data = compat.TfDataState(epoch_iterator)
        self.grain = compat.GrainView.of(epoch_iterator, self._after_batch)
        self.arrays = compat.ArrayView.of(epoch_iterator)

    def begin_epoch(self) -> None:
        """Call before the epoch's pipeline starts (at `on_epoch_begin`)."""
        self._loads = 0
        self._before.clear()
        self._resume_rng = None
        if self._reshuffling is not None:
            # Made at the last epoch's end too (TensorFlow), and this epoch's.
            self._iterators += 2 if compat.made_ahead(self.epoch_iterator) else 1
        self._epoch_values = self.variable_values(None)
        self._stream_start = compat.stream_position(self.epoch_iterator)
        if self._stream_start == 0:  # A pass begins.
            # PyTorch's generator too: a `DataLoader` draws from it.
            self._stream_rng = rng.capture()
            self._stream_values = self._epoch_values
            self._stream_made = compat.stream_made(self.epoch_iterator)
        if self.view is not None:
            self.view.skip([], placeholders=False)
        if self.arrays is not None:
            self.arrays.skip(0)

    def state_at(self, batch: int) -> dict[str, Any] | None:
        """What a backup after the epoch's first `batch` items notes of the
        input, or `None` if a resume from it must replay them."""
        if self.grain is not None:
            state = _kept(self._before, batch)
            try:
                text = json.dumps(state) if state is not None else None
            except (TypeError, ValueError):
                text = None  # Not plain data: replayed.
            if text is None:
                return None
            return {"grain": np.frombuffer(text.encode(), dtype=np.uint8)}
        if self.view is None:
            state = self._tf_data.save()
            if state is None:
                return None
            return {"tf_iterator": np.frombuffer(state, dtype=np.uint8)}
        if not self.view.sequential:
            return {}
        kept = _kept(self._before, batch)
        if kept is None and self._loads <= batch:
            now = rng.capture_raw()
            # If the load of `batch` began meanwhile, it noted its own state.
            kept = _kept(self._before, batch) or now
        return None if kept is None else {"rng": rng.from_raw(kept)}

    def stream_at(self, batch: int | None) -> dict[str, Any] | None:
        """Where a stream read across epochs (see the module's docstring)
        is after the epoch's first `batch` (`None`: the whole epoch, at its
        end): `{"stream": batches drawn, "stream_rng": the data side's
        generators when its pass began, "stream_made": whether its iterator
        was made before that}`, or `None` for other input."""
        if self._stream_start is None:
            return None
        made = self._stream_made
        if batch is None:  # Keras may have made a new iterator: it knows.
            drawn = compat.stream_position(self.epoch_iterator)
            if not drawn:  # The next pass begins with the next epoch.
                made = compat.stream_made(self.epoch_iterator)
        else:
            drawn = self._stream_start + batch
        if drawn is None or not (drawn or made):
            return None  # A new stream: nothing to draw again.
        stream = {
            "stream": drawn,
            "stream_rng": self._stream_rng or {},
            "stream_made": made,
        }
        if self._stream_values is not None:
            stream["stream_variables"] = self._stream_values
        return stream

    def iterators_made(self, batch: int | None) -> int | None:
        """How many iterators of a reshuffling `tf.data` pipeline Keras made
        before the epoch that a resume from a save after the epoch's first
        `batch` begins with (`None`: at the epoch's end): the orders it drew
        before. `None` for other input."""
        if self._reshuffling is None or self._stream_start is not None:
            return None
        if batch:
            return self._iterators
        return self._iterators + (2 if compat.made_ahead(self.epoch_iterator) else 1)

    def variable_values(self, batch: int | None) -> list[np.ndarray] | None:
        """The values of the `tf.data` pipeline's variables (see the module's
        docstring) that a resume from a save after the epoch's first `batch`
        sets (`None`: at the epoch's end, for the next epoch): as the epoch
        began, or as now. `None` where the pipeline uses none."""
        if not self._variables:
            return None
        if batch:
            return self._epoch_values
        return [np.array(v.numpy()) for v in self._variables]

    def dataset_state(self) -> Any:
        """What the `PyDataset` says its state is (see the module's
        docstring), copied: it may change its arrays in place while the
        save is written. `None` where it has no `get_state()`."""
        if not _keeps_state(self.dataset):
            return None
        state = self.dataset.get_state()
        arrays.check_tree(state, f"{type(self.dataset).__name__}.get_state()")
        return copy.deepcopy(state)

    def set_dataset_state(self, point: ResumePoint) -> None:
        """At the resumed epoch's begin: the `PyDataset`'s saved state back,
        and the `tf.data` pipeline's variables as the epoch began."""
        saved = point.extra.get("dataset")
        if saved is not None and _keeps_state(self.dataset):
            self.dataset.set_state(saved)
        self._set_variables(point.extra.get("input_variables"))
        made = point.extra.get("input_iterators")
        # At most two an epoch (TensorFlow's made ahead): a count beyond that
        # is a damaged backup's, not one to spend the resume making.
        self._caught_up = type(made) is int and 0 <= made <= 2 * point.epoch + 2
        if self._reshuffling is not None and self._caught_up:
            # Each makes the pipeline draw an order, as the first run's epochs
            # before this one did: this epoch's iterator draws its own.
            while self._iterators < made:
                iter(self._reshuffling)
                self._iterators += 1

    def _set_variables(self, values: Any) -> None:
        if values is None or not self._variables:
            return
        fits = isinstance(values, list) and len(values) == len(self._variables)
        fits = fits and all(
            isinstance(value, np.ndarray)
            and value.shape == tuple(v.shape)
            and value.dtype == v.dtype.as_numpy_dtype
            for value, v in zip(values, self._variables, strict=True)
        )
        if not fits:
            events.warn(
                "restore",
                "BackupAndRestore: the tf.data pipeline's variables (a random "
                "layer's seed in `map()`, say) are not those backed up (another "
                "pipeline): they start afresh, and its random draws differ from "
                "the uninterrupted run's.",
                stacklevel=4,
            )
            return
        for variable, value in zip(self._variables, values, strict=True):
            variable.assign(value)

    def warn_unsaved(self) -> None:
        """Names a `PyDataset` whose epoch hooks may change it, but whose
        state no backup holds."""
        dataset = self.dataset
        if dataset is None or _keeps_state(dataset):
            return
        hooks = [
            f"{name}()"
            for name in ("on_epoch_begin", "on_epoch_end")
            if getattr(type(dataset), name) is not getattr(keras.utils.PyDataset, name)
        ]
        if hooks:
            events.warn(
                "save",
                f"BackupAndRestore: {type(dataset).__name__}, the PyDataset "
                f"fit() reads, defines {' and '.join(hooks)} but no get_state()/"
                "set_state(): what they change (an order shuffled each epoch, "
                "say) is not backed up, and a resumed fit() reads the data as a "
                "new one has it. Define both methods to carry it (JSON values "
                "and NumPy arrays; see keras_ft.training.callback_state).",
                stacklevel=5,
            )

    def ran_out(self) -> bool:
        """At an epoch's end, whether a stream (see the module's docstring)
        ran out in it: Keras counts the epoch as run, and reads the input
        from its start in the next one."""
        return compat.stream_position(self.epoch_iterator) == 0

    def advance_stream(self, point: ResumePoint) -> bool:
        """At the resumed epoch's begin, in a stream read across epochs:
        makes its iterator where the uninterrupted run had made it before
        (so that what making it draws comes before the random state put
        back), and draws the batches of the pass before that epoch again
        (not trained), leaving the training steps' generators as they were;
        the epoch's own trained batches are skipped as any input's.

        Returns whether it drew them: the data side's generators are then
        where those draws left them, in the order the uninterrupted run
        drew, which a state noted at the save cannot give where the input
        loads ahead on a thread of its own (a generator on TensorFlow): a
        resume leaves them so."""
        saved = point.extra.get("input")
        stream = saved.get("stream") if isinstance(saved, dict) else None
        if stream is None or self._stream_start is None:
            return False
        # Noted again by this process's saves: the stream is the same.
        self._stream_rng = saved.get("stream_rng") or self._stream_rng
        self._stream_values = saved.get("stream_variables", self._stream_values)
        self._stream_made = made = saved.get("stream_made") is True
        if point.batch and "tf_iterator" in saved:
            return False  # Restored exactly from the iterator's state.
        before = stream - point.batch
        kind = compat.input_kind(self.epoch_iterator)
        if before <= 0 and not made:
            return False  # Keras makes the pass's iterator as it did.
        state, drawn = rng.capture(), False
        try:
            # Made at the last pass's end, before this pass's state was noted:
            # what making it draws is in that state already.
            if made and not compat.make_stream(self.epoch_iterator):
                return False
            if before <= 0:
                return False
            rng.apply(saved.get("stream_rng", {}))
            self._set_variables(saved.get("stream_variables"))
            if not made and not compat.make_stream(self.epoch_iterator):
                return False
            drawn = compat.advance_stream(self.epoch_iterator, before)
            if not drawn:
                return False
        finally:
            rng.apply(state, only=rng.model_side() if drawn else None)
        self._stream_start = before
        if kind == "GeneratorDataAdapter":
            self._warn_generator(stream)
        return True

    def skip(self, point: ResumePoint) -> bool:
        """Sets up the resumed epoch to skip its trained items at the source.

        Call once the random state of the epoch's beginning is back in place.
        Returns whether it does (the skipped steps then pull nothing); if
        not, they pull the trained batches again. Arrays are pulled again,
        but as placeholders sliced from nothing: Keras draws the epoch's
        order (and a batch-wise shuffle's) as it did, and copies no row.
        """
        if self.arrays is not None and point.batch:
            self.arrays.skip(point.batch)
            return False
        saved = point.extra.get("input")
        if not isinstance(saved, dict) or not point.batch:
            return False
        if self.grain is not None and "grain" in saved:
            state = grain_state(saved["grain"])
            if state is None:
                return False  # Damaged: replayed.
            self.grain.skip(state, point.batch, fit_loop.loop_pulls_batches())
            return True
        if self.view is None:
            return False
        if self.view.sequential and "rng" not in saved:
            return False
        indices = self.view.trained_indices(point.batch)
        if indices is None:
            return False
        self.view.skip(indices, placeholders=fit_loop.loop_pulls_batches())
        self._loads = point.batch
        if self.view.sequential:
            self._resume_rng = saved["rng"]
        return True

    def restore_iterator(self, point: ResumePoint, iterator: Any) -> bool:
        """Puts the saved state into the resumed epoch's iterator, at its
        first step; returns whether it did (if not, the trained batches are
        drawn through it again)."""
        saved = point.extra.get("input")
        if not isinstance(saved, dict) or "tf_iterator" not in saved:
            return False
        state = np.asarray(saved["tf_iterator"], dtype=np.uint8).tobytes()
        return compat.restore_tf_iterator(iterator, state)

    def replaying(self, count: int) -> None:
        """Says so where the input can only replay the `count` batches of the
        resumed epoch trained before the restart (a Python generator), or
        cannot replay them in their order (a `tf.data` pipeline that
        reshuffles, replayed from a backup that does not say how many orders
        it drew before: one written by an earlier keras-ft)."""
        if self._reshuffling is not None and not self._caught_up:
            events.warn(
                "restore",
                "BackupAndRestore: the tf.data pipeline reshuffles at every "
                "iteration (`Dataset.shuffle()`), and the backup (from an "
                "earlier keras-ft) does not say how many orders it drew before "
                "the restart: the rest of this epoch is trained on batches in "
                "another order. Backups written from now on resume it exactly.",
                stacklevel=2,
            )
        elif compat.input_kind(self.epoch_iterator) == "GeneratorDataAdapter":
            if self._stream_start:
                return  # Said with the stream's batches before the epoch.
            self._warn_generator(count)

    def _warn_generator(self, count: int) -> None:
        events.warn(
            "restore",
            "BackupAndRestore: a Python generator cannot skip what it "
            f"yielded: the {count} batches it yielded before the backup are "
            "drawn from it again (not trained), so that training goes on with "
            "the batches the uninterrupted run had. A keras.utils.PyDataset "
            "(or a tf.data pipeline on the TensorFlow backend) resumes without "
            "loading them.",
            stacklevel=3,
        )

    def leave_grain(self) -> None:
        """Replays a Grain dataset's trained batches on resume rather than
        setting its iterator's saved state."""
        if self.grain is not None:
            self.grain.remove()
            self.grain = None

    def remove(self) -> None:
        """Gives `fit()` its input back as it was."""
        if self.view is not None:
            self.view.remove()
            self.view = None
        if self.arrays is not None:
            self.arrays.remove()
            self.arrays = None
        self.leave_grain()
        self.epoch_iterator = None
        self._tf_data = compat.TfDataState(None)

    def _after_batch(self, position: int, state: dict) -> None:
        # A Grain iterator's state after the epoch's first `position` batches.
        self._before.append((position, state))

    def _before_load(self, index: int) -> None:
        # In the loading thread: the main thread or a prefetching one.
        if self._resume_rng is not None:
            state, self._resume_rng = self._resume_rng, None
            rng.apply(state)
        if self.view is not None and self.view.sequential:
            self._before.append((self._loads, rng.capture_raw()))
            self._loads += 1


def _keeps_state(dataset: Any) -> bool:
    return callable(getattr(dataset, "get_state", None)) and callable(
        getattr(dataset, "set_state", None)
    )


def grain_state(saved: Any) -> dict | None:
    """The Grain iterator state a backup holds (JSON bytes), or `None` when
    they are not one. A backup is untrusted input: only plain data comes out,
    and Grain's `set_state()` refuses what its iterator does not know."""
    try:
        text = np.asarray(saved, dtype=np.uint8).tobytes().decode()
        state = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return state if isinstance(state, dict) else None


def _kept(before: collections.deque, position: int) -> Any:
    for loaded, state in list(before):  # Copied at once: a loader appends.
        if loaded == position:
            return state
    return None
