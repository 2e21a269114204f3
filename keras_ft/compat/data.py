"""Internals of Keras' data adapters: the input a running `fit()` reads.

`fit()` gives callbacks no handle on its data: its `epoch_iterator`, and the
data adapter behind it, are locals a few frames up from `on_train_begin`.
Through them keras-ft counts epochs for adapters that shuffle by epoch, and
lets a resumed epoch skip the `PyDataset` items trained before the restart
instead of loading them again.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

from keras_ft.compat.registry import available, fail, register, usable
from keras_ft.compat.training import code_names, local_up_the_stack


def fit_epoch_iterator() -> Any:
    """The running `fit()`'s `epoch_iterator`, or `None` if not found.

    Call from inside `on_train_begin` (it walks up to 10 frames).
    """
    if not hasattr(sys, "_getframe"):
        return None
    return local_up_the_stack(
        sys._getframe(1),
        10,
        "epoch_iterator",
        lambda iterator: getattr(iterator, "data_adapter", None) is not None,
    )


def _adapter_counts_epochs() -> bool:
    # Keras 3.16 shuffles arrays from the data adapter's own count of epochs,
    # which every fit() starts at 0; earlier releases draw from NumPy's global
    # generator, which the backup holds.
    from keras.src.trainers.data_adapters import array_data_adapter

    adapter = array_data_adapter.ArrayDataAdapter
    return "_epoch" in code_names(adapter.__init__)


def input_kind(epoch_iterator: Any) -> str | None:
    """The class name of the data adapter `fit()` reads through (Keras'
    `GeneratorDataAdapter`, `TFDatasetAdapter`, ...), or `None`."""
    adapter = getattr(epoch_iterator, "data_adapter", None)
    return None if adapter is None else type(adapter).__name__


def fit_tf_dataset(epoch_iterator: Any) -> Any:
    """The user's `tf.data.Dataset` that `fit()` reads, on any backend, or
    `None` if its input is something else."""
    if input_kind(epoch_iterator) != "TFDatasetAdapter":
        return None
    try:
        return epoch_iterator.data_adapter.get_tf_dataset()
    except Exception:  # Not one to look into: no warning depends on it alone.
        return None


@register(
    "tf_data_variables",
    "the variables a tf.data pipeline's functions use (the seed of a Keras "
    "random layer in `map()`, augmenting) start afresh at a resume: the "
    "resumed run's augmentation differs",
    # A tf.data pipeline has TensorFlow imported, whatever Keras' backend.
    applies=lambda: "tensorflow" in sys.modules,
)
def _check_tf_data_variables() -> bool:
    import tensorflow as tf

    # Not converted by AutoGraph, which would write its code into TMPDIR.
    mapped = tf.data.Dataset.range(2).map(
        tf.autograph.experimental.do_not_convert(lambda x: x + 1)
    )
    functions = mapped._functions()
    return (
        bool(functions)
        and isinstance(functions[0].function.variables, tuple | list)
        and list(mapped._inputs())[0]._functions() == []
    )


def tf_dataset_variables(dataset: Any) -> list:
    """The `tf.Variable`s that the functions of a `tf.data.Dataset` (or of a
    pipeline it reads) use, in a fixed order: state that lives outside the
    pipeline (a Keras random layer's seed generator, which each batch
    `map()` augments advances). `[]` for anything else."""
    if dataset is None or not usable("tf_data_variables"):
        return []
    found: dict[int, Any] = {}
    try:
        for part in _pipeline(dataset):
            for wrapper in part._functions():
                for variable in wrapper.function.variables:
                    found.setdefault(id(variable), variable)
    except Exception as e:
        fail("tf_data_variables", e)
        return []
    return list(found.values())


@register(
    "tf_data_reshuffle",
    "no warning is given when a tf.data pipeline that reshuffles each epoch "
    "is resumed mid-epoch (its batches then come in another order)",
    # A tf.data pipeline has TensorFlow imported, whatever Keras' backend.
    applies=lambda: "tensorflow" in sys.modules,
)
def _check_tf_data_reshuffle() -> bool:
    import tensorflow as tf

    shuffled = tf.data.Dataset.range(2).shuffle(2)
    return getattr(shuffled, "_reshuffle_each_iteration", None) is True and bool(
        list(shuffled._inputs())
    )


def tf_dataset_reshuffles(dataset: Any) -> bool:
    """Whether a `tf.data.Dataset` (or a pipeline it reads) reshuffles.

    `Dataset.shuffle()` draws a new order for every new iterator from a seed
    generator inside the pipeline, which only the iterator's own saved state
    carries; a restarted process that replays the epoch therefore sees the
    order of the first epoch, not of the one it resumes. (Keras' own pipeline
    for NumPy arrays shuffles differently.)
    """
    if dataset is None or not usable("tf_data_reshuffle"):
        return False
    try:
        return any(
            "Shuffle" in type(part).__name__
            and getattr(part, "_reshuffle_each_iteration", False)
            for part in _pipeline(dataset)
        )
    except Exception as e:
        fail("tf_data_reshuffle", e)
        return False


def _pipeline(dataset: Any) -> Iterator[Any]:
    """`dataset` and every dataset it reads (`_inputs()`), each once,
    nearest first."""
    pending, seen = [dataset], set()
    while pending:
        dataset = pending.pop(0)
        if id(dataset) not in seen:
            seen.add(id(dataset))
            yield dataset
            pending.extend(dataset._inputs())


def py_dataset(epoch_iterator: Any) -> Any:
    """What `fit()`'s data adapter loads items from (a `PyDataset`), or
    `None` (another input, or an internal that moved)."""
    adapter = getattr(epoch_iterator, "data_adapter", None)
    return getattr(adapter, "py_dataset", None)


def loads_in_processes(epoch_iterator: Any) -> bool:
    """Whether `fit()`'s input loads in worker processes: a `PyDataset` with
    `use_multiprocessing` (Keras waits, without a bound, for an item whose
    worker was killed: by the OOM killer, say)."""
    adapter = getattr(epoch_iterator, "data_adapter", None)
    dataset = getattr(adapter, "py_dataset", None)
    try:
        # Keras' own rule for an enqueuer of processes.
        return bool(dataset.use_multiprocessing) and dataset.workers > 0
    except Exception:  # Another input, or an internal that moved.
        return False


@register(
    "data_epoch",
    "a fit() resumed at a later epoch shuffles arrays in the order of its own "
    "first epoch, not of the epoch it resumes (not bitwise-exact)",
    applies=_adapter_counts_epochs,
)
def _check_data_epoch() -> bool:
    return hasattr(sys, "_getframe") and _adapter_counts_epochs()


def start_data_at_epoch(epoch_iterator: Any, epoch: int) -> None:
    """Has `fit()`'s data adapter count `epoch` epochs as done.

    Adapters that keep no count (a generator, `tf.data`, arrays and
    `PyDataset`s before Keras 3.16) are left alone.
    """
    if not epoch or not available("data_epoch"):
        return
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None:
        fail("data_epoch", LookupError("fit() has no local `epoch_iterator`"))
        return
    if isinstance(getattr(adapter, "_epoch", None), int):
        # Advanced, not set: fit() has already counted an epoch or not,
        # depending on how it built the model.
        adapter._epoch += epoch


def _py_dataset_adapter_types() -> tuple[type, type]:
    from keras.src.trainers.data_adapters import py_dataset_adapter

    return py_dataset_adapter.PyDatasetAdapter, py_dataset_adapter.OrderedEnqueuer


@register(
    "input_skip",
    "a resumed epoch loads the PyDataset items trained before the restart "
    "again (they are replayed, not skipped)",
)
def _check_input_skip() -> bool:
    adapter, enqueuer = _py_dataset_adapter_types()
    return (
        {"_finite_generator", "_finite_enqueuer_generator"}
        <= code_names(adapter._get_iterator)
        and "py_dataset" in code_names(adapter._finite_generator)
        and "py_dataset" in code_names(enqueuer._send_py_dataset)
    )


class Skipped(tuple):
    """What a `PyDataset` item skipped at the source loads as: nothing.

    A one-element tuple, so that Keras' batch checks pass it through.
    """


_SKIPPED = Skipped((None,))


class PyDatasetView:
    """The `PyDataset` a `fit()` reads, seen through on its way in.

    Installs itself as the adapter's (and its enqueuer's) dataset for the
    fit: every item load passes `before_load` first (the training keeps the
    random state an item starts from), and items given to `skip()` load
    nothing: Keras' own generator draws the epoch's order and asks for them
    as ever, and gets a `Skipped` marker that the view's generator drops (or
    hands on as an empty tuple, for a `fit()` loop that pulls a batch for
    every step itself).

    Args:
        adapter: The `PyDatasetAdapter` of `fit()`'s epoch iterator.
        before_load: Called with each index before its item is loaded.
    """

    def __init__(self, adapter: Any, before_load: Callable[[int], None]):
        self._adapter = adapter
        self.dataset = adapter.py_dataset
        self.sequential = getattr(adapter, "enqueuer", None) is None
        self._seen = _Seen(self.dataset, before_load)
        self._placeholders = False
        self._set_dataset(self._seen)
        kind = type(adapter)
        adapter._finite_generator = lambda: self._drop_skipped(
            kind._finite_generator(adapter)
        )
        adapter._finite_enqueuer_generator = lambda: self._drop_skipped(
            kind._finite_enqueuer_generator(adapter)
        )

    @classmethod
    def of(cls, epoch_iterator: Any, before_load: Callable[[int], None]) -> Any:
        """A view of `epoch_iterator`'s `PyDataset`, or `None` (another input,
        one of unknown length, or an internal that moved)."""
        adapter = getattr(epoch_iterator, "data_adapter", None)
        adapter_type, _ = _py_dataset_adapter_types()
        # A subclass may draw its order otherwise.
        if type(adapter) is not adapter_type or not usable("input_skip"):
            return None
        steps = getattr(epoch_iterator, "steps_per_epoch", None)
        num_batches = adapter.py_dataset.num_batches
        if num_batches is None or steps not in (None, num_batches):
            # Epochs that are not one pass: the iterator runs across them.
            return None
        try:
            return cls(adapter, before_load)
        except Exception as e:
            fail("input_skip", e)
            return None

    def trained_indices(self, count: int) -> list[int] | None:
        """The indices of the epoch's first `count` items, in its order.

        Runs Keras' own generator with nothing loaded, from the random state
        the pipeline is about to draw the epoch's order from (and leaves that
        state as it was). The enqueuer of a `PyDataset` with workers draws
        the same order from the same state.
        """
        adapter = self._adapter
        recorder = _Recorder(self.dataset)
        state = random.getstate()
        self._set_dataset(recorder)
        try:
            batches = type(adapter)._finite_generator(adapter)
            list(itertools.islice(batches, count))
            batches.close()
        except Exception as e:
            fail("input_skip", e)
            return None
        finally:
            self._set_dataset(self._seen)
            random.setstate(state)
        return recorder.indices if len(recorder.indices) == count else None

    def skip(self, indices: list[int], placeholders: bool) -> None:
        """Has the next loads of `indices` load nothing.

        Args:
            placeholders: Hand an empty tuple on for each (PyTorch's `fit()`
                pulls a batch for every step, skipped or not), instead of
                dropping them.
        """
        self._placeholders = placeholders
        self._seen.skipping = set(indices)
        enqueuer = getattr(self._adapter, "enqueuer", None)
        if indices and enqueuer is not None:
            # Items an earlier run of the enqueuer loaded and left (fit()
            # pulls a batch to build the model, then stops it), which it
            # would hand out first; an uninterrupted run's later epochs
            # start without them.
            leftovers = enqueuer.ready_queue
            while not leftovers.empty():
                leftovers.get_nowait()

    def remove(self) -> None:
        """Gives the adapter its dataset and generators back."""
        adapter = self._adapter
        if adapter.py_dataset is self._seen:
            self._set_dataset(self.dataset)
        for name in ("_finite_generator", "_finite_enqueuer_generator"):
            vars(adapter).pop(name, None)

    def _set_dataset(self, dataset: Any) -> None:
        self._adapter.py_dataset = dataset
        enqueuer = getattr(self._adapter, "enqueuer", None)
        if enqueuer is not None:
            enqueuer.py_dataset = dataset

    def _drop_skipped(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            if type(batch) is Skipped:
                if self._placeholders:
                    yield ()  # No leaves: every Keras converts it as is.
                continue
            yield batch


class _Seen:
    """A `PyDataset` stand-in: loads pass a hook, skipped ones load nothing.

    Runs in Keras' loading threads, and in its worker processes (forked with
    the set of skipped indices): no locks, whose state a fork could copy
    held; `set.remove()` is atomic.
    """

    def __init__(self, dataset: Any, before_load: Callable[[int], None] | None):
        self.dataset = dataset
        self.before_load = before_load
        self.skipping: set[int] = set()

    def __getitem__(self, index: int) -> Any:
        if self.skipping:
            try:
                self.skipping.remove(index)
            except KeyError:
                pass
            else:
                return _SKIPPED
        if self.before_load is not None:
            self.before_load(index)
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "before_load", "skipping", "indices"):
            # Not set yet (mid-unpickling): not the dataset's.
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker process skips alike, and records nothing back.
        state = dict(vars(self))
        state["before_load"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


class _Recorder(_Seen):
    """Notes the indices asked for; loads nothing."""

    def __init__(self, dataset: Any):
        super().__init__(dataset, None)
        self.indices: list[int] = []

    def __getitem__(self, index: int) -> Skipped:
        self.indices.append(index)
        return _SKIPPED


def _array_adapter_type() -> type:
    from keras.src.trainers.data_adapters import array_data_adapter

    return array_data_adapter.ArrayDataAdapter


def _slices_arrays_in_python() -> bool:
    # TensorFlow slices arrays inside tf.data: replayed there.
    import keras

    return keras.backend.backend() in ("jax", "torch")


@register(
    "array_skip",
    "a resumed epoch slices the NumPy arrays' batches trained before the "
    "restart again (they are replayed, not skipped)",
    applies=_slices_arrays_in_python,
)
def _check_array_skip() -> bool:
    import keras

    adapter = _array_adapter_type()
    if keras.backend.backend() == "jax":
        # The slicing is the function it is handed, called with the indices.
        return "_get_iterator" in code_names(adapter.get_jax_iterator)
    return "DataLoader" in code_names(adapter.get_torch_dataloader)


# What a skipped batch of arrays is: an empty tuple, a structure with no
# leaves (a tuple subclass would be one leaf to JAX), which Keras' loops and
# keras-ft's skipped steps take as they take any batch; no real batch is one.
_PLACEHOLDER: tuple = ()


def is_placeholder(batch: Any) -> bool:
    """Whether `batch` is one a resumed epoch skipped at the source."""
    return (type(batch) is tuple and not batch) or type(batch) is Skipped


class ArrayView:
    """The NumPy arrays (or tensors) a `fit()` reads, on JAX and PyTorch.

    Keras slices each batch out of the arrays when it is pulled. Given
    `skip(count)`, the epoch's next `count` batches are pulled as before
    (Keras draws the epoch's order, and a batch-wise shuffle's, when it did)
    but each is an empty placeholder, sliced from nothing: a resumed epoch
    does not copy the rows it trained before the restart.

    Args:
        adapter: The `ArrayDataAdapter` of `fit()`'s epoch iterator.
    """

    def __init__(self, adapter: Any):
        import keras

        self._adapter = adapter
        self._count = 0
        kind = type(adapter)
        if keras.backend.backend() == "jax":
            adapter._get_iterator = lambda convert, inputs: self._dropping(
                kind._get_iterator, convert, inputs
            )
        else:
            adapter.get_torch_dataloader = lambda: self._loader(
                kind.get_torch_dataloader(adapter)
            )

    @classmethod
    def of(cls, epoch_iterator: Any) -> Any:
        """A view of `epoch_iterator`'s arrays, or `None` (another input,
        TensorFlow, epochs that are not one pass, or an internal that
        moved)."""
        adapter = getattr(epoch_iterator, "data_adapter", None)
        if adapter is None or not _slices_arrays_in_python():
            return None
        # A subclass may slice otherwise.
        if type(adapter) is not _array_adapter_type() or not usable("array_skip"):
            return None
        steps = getattr(epoch_iterator, "steps_per_epoch", None)
        if steps not in (None, getattr(adapter, "num_batches", None)):
            return None  # The iterator runs across epochs.
        import keras

        if keras.distribution.distribution() is not None:
            # JAX lays each batch out after the first one it sees.
            return None
        try:
            return cls(adapter)
        except Exception as e:
            fail("array_skip", e)
            return None

    def skip(self, count: int) -> None:
        """Has the next `count` batches pulled be placeholders."""
        self._count = count

    def remove(self) -> None:
        """Gives the adapter its own methods back."""
        for name in ("_get_iterator", "get_torch_dataloader"):
            vars(self._adapter).pop(name, None)

    def _dropping(self, generate: Callable, convert: Callable, inputs: Any) -> Any:
        skipping = False

        def sliced(sliceable: Any, indices: Any = None) -> Any:
            return None if skipping else convert(sliceable, indices=indices)

        batches = generate(self._adapter, sliced, inputs)
        while True:
            skipping = self._count > 0
            try:
                batch = next(batches)
            except StopIteration:
                return
            if skipping:
                self._count -= 1
                batch = _PLACEHOLDER
            yield batch

    def _loader(self, loader: Any) -> Any:
        dataset = loader.dataset
        getitems = getattr(dataset, "__getitems__", None)
        if getitems is None:
            # Batches put together item by item: replayed.
            fail("array_skip", LookupError("the arrays' dataset has no __getitems__"))
            return loader

        def sliced(indices: Any) -> Any:
            if self._count > 0:
                self._count -= 1
                return _PLACEHOLDER  # The collate function keeps it as is.
            return getitems(indices)

        # The loader's fetcher looks the method up on the instance.
        dataset.__getitems__ = sliced
        return loader


def _is_tensorflow() -> bool:
    import keras

    return keras.backend.backend() == "tensorflow"


@register(
    "tf_data_position",
    "a tf.data pipeline resumed mid-epoch draws the trained batches again, "
    "and one that reshuffles (`Dataset.shuffle()`) goes on in another order",
    applies=_is_tensorflow,
)
def _check_tf_data_position() -> bool:
    import tensorflow as tf
    from keras.src.trainers.epoch_iterator import EpochIterator

    iterator = iter(tf.data.Dataset.range(1))
    return (
        getattr(iterator, "_iterator_resource", None) is not None
        and hasattr(tf.raw_ops, "SerializeIterator")
        and hasattr(tf.raw_ops, "DeserializeIterator")
        and getattr(getattr(iterator, "_dataset", None), "_variant_tensor", None)
        is not None
        and "_current_iterator" in code_names(EpochIterator._enumerate_iterator)
    )


def _tf_dataset_iterator(epoch_iterator: Any) -> Any:
    """The iterator of a user's `tf.data.Dataset` that `fit()` is reading."""
    if input_kind(epoch_iterator) != "TFDatasetAdapter" or not _is_tensorflow():
        # Arrays, generators, PyDatasets: not the user's pipeline; on another
        # backend, Keras reads it through NumPy. Checked before the
        # capability, whose check imports TensorFlow.
        return None
    if not usable("tf_data_position"):
        return None
    iterator = getattr(epoch_iterator, "_current_iterator", None)
    # A distributed iterator (a strategy's) has no state of its own to save.
    return iterator if hasattr(iterator, "_iterator_resource") else None


class TfDataState:
    """Saves the state of the `tf.data` iterator a `fit()` reads.

    The state is TensorFlow's serialized iterator (as `tf.train.Checkpoint`
    writes it, without the base64 text `iterator._save()` makes of it: 15x
    faster). A pipeline with state outside the graph (a `py_function`'s)
    cannot be saved: TensorFlow would skip that state; here the pipeline is
    not saved at all (found out once), and a resume replays it.

    Args:
        epoch_iterator: `fit()`'s epoch iterator.
    """

    def __init__(self, epoch_iterator: Any):
        self._epoch_iterator = epoch_iterator
        self._savable = True

    def save(self) -> bytes | None:
        """The iterator's state, buffers included, or `None`."""
        iterator = _tf_dataset_iterator(self._epoch_iterator)
        if iterator is None or not self._savable:
            return None
        import tensorflow as tf

        try:
            state = tf.raw_ops.SerializeIterator(
                resource_handle=iterator._iterator_resource,
                external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL.value,
            )
            return tf.io.serialize_tensor(state).numpy()
        except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError):
            self._savable = False  # Replayed on resume.
        except Exception as e:
            fail("tf_data_position", e)
        return None


def restore_tf_iterator(iterator: Any, state: bytes) -> bool:
    """Puts `state` (from `TfDataState.save()`) into `fit()`'s new iterator
    for the epoch, before it yields anything; returns whether it did."""
    if not hasattr(iterator, "_iterator_resource") or not usable("tf_data_position"):
        return False
    import tensorflow as tf

    resource = iterator._iterator_resource
    try:
        tf.raw_ops.DeserializeIterator(
            resource_handle=resource, serialized=tf.io.parse_tensor(state, tf.variant)
        )
    except tf.errors.OpError:
        # Damaged, or another pipeline than the one saved: replayed. A restore
        # that failed part way leaves the iterator empty: start it afresh.
        try:
            tf.raw_ops.MakeIterator(
                dataset=iterator._dataset._variant_tensor, iterator=resource
            )
        except Exception as e:
            fail("tf_data_position", e)
            raise  # An empty epoch would be trained silently: better stop.
        return False
    except Exception as e:
        fail("tf_data_position", e)
        return False
    return True


# Inputs Keras reads as one stream across the epochs of a fit() given
# `steps_per_epoch`: it makes their iterator once, and anew only when a
# finite one runs out (arrays, a PyDataset and a DataLoader longer than
# `steps_per_epoch` included: an epoch goes on where the last one stopped).
_STREAMS = (
    "GeneratorDataAdapter", "TFDatasetAdapter", "ArrayDataAdapter",
    "PyDatasetAdapter", "TorchDataLoaderAdapter",
)  # fmt: skip


@register(
    "stream_position",
    "an input read with steps_per_epoch (an endless generator, a repeated "
    "tf.data pipeline, arrays, a PyDataset or a DataLoader longer than it) "
    "resumes where "
    "its epoch began drawing, not where the stream was, and an epoch the "
    "input ran out in counts as stopped: other batches than the "
    "uninterrupted run's",
)
def _check_stream_position() -> bool:
    from keras.src.trainers.epoch_iterator import EpochIterator

    names = code_names(EpochIterator._enumerate_iterator)
    return {"_current_iterator", "_steps_seen"} <= names and callable(
        getattr(EpochIterator, "_get_iterator", None)
    )


def stream_position(epoch_iterator: Any) -> int | None:
    """Batches `fit()` has drawn from its input's current iterator, where
    it reads the input as one stream across epochs (any input of `_STREAMS`,
    with `steps_per_epoch`): Keras' `_steps_seen`, 0 before it made one and
    once the input ran out. `None` for other input (restarted each epoch)."""
    if input_kind(epoch_iterator) not in _STREAMS:
        return None
    if not getattr(epoch_iterator, "steps_per_epoch", None):
        return None
    if not usable("stream_position"):
        return None
    if getattr(epoch_iterator, "_current_iterator", None) is None:
        return 0
    return int(getattr(epoch_iterator, "_steps_seen", 0))


def stream_made(epoch_iterator: Any) -> bool:
    """Whether `fit()`'s stream (`stream_position()`) has its iterator."""
    return getattr(epoch_iterator, "_current_iterator", None) is not None


def made_ahead(epoch_iterator: Any) -> bool:
    """At an epoch's end or the next one's begin: whether Keras has made the
    next epoch's `tf.data` iterator already (TensorFlow, a pipeline of known
    length), and so drawn its order. On the other backends the iterator is
    made in a Python generator when it first yields."""
    if not usable("stream_position") or getattr(epoch_iterator, "_steps_seen", 1):
        return False
    return _tf_dataset_iterator(epoch_iterator) is not None


def make_stream(epoch_iterator: Any) -> bool:
    """Gives `fit()`'s stream a new iterator now, as Keras makes one (on
    PyTorch, making a `DataLoader`'s iterator draws from PyTorch's
    generator); returns whether it did."""
    try:
        epoch_iterator._current_iterator = iter(epoch_iterator._get_iterator())
    except Exception as e:
        fail("stream_position", e)
        return False
    epoch_iterator._steps_seen = 0
    return True


def advance_stream(epoch_iterator: Any, count: int) -> bool:
    """Draws `count` batches from `fit()`'s stream (`make_stream()`), before
    the epoch reads it; returns whether it did."""
    try:
        for _ in range(count):
            next(epoch_iterator._current_iterator)
    except StopIteration:
        # Shorter than the backup says: read as it comes.
        epoch_iterator._current_iterator = None
        return False
    except Exception as e:
        fail("stream_position", e)
        epoch_iterator._current_iterator = None
        return False
    epoch_iterator._steps_seen = count
    return True


@register(
    "validation_generator",
    "a Python generator as `validation_data` starts again at its first batch "
    "after a resume: the resumed run validates on other batches",
)
def _check_validation_generator() -> bool:
    from keras.src.trainers.data_adapters import generator_data_adapter

    init = generator_data_adapter.GeneratorDataAdapter.__init__
    return {"_first_batches", "generator"} <= code_names(init)


def count_validation_draws(
    model: Any, count: Callable[[], None]
) -> tuple[Iterator, int | None] | None:
    """`fit()`'s `validation_data` where it is a Python generator, once Keras
    has made its adapter (at the first validation's begin), and its
    `validation_steps`: from then on, `count()` is called for each batch
    Keras draws from it after the first two (which Keras drew to learn their
    shapes, and yields again at each validation's begin). `None` where the
    validation data is another input."""
    iterator = getattr(model, "_eval_epoch_iterator", None)
    adapter = getattr(iterator, "data_adapter", None)
    if type(adapter).__name__ != "GeneratorDataAdapter":
        return None
    if not usable("validation_generator"):
        return None
    try:
        # `generator` makes `itertools.chain(first batches, the generator)`.
        make = adapter.generator
        cells = [cell.cell_contents for cell in make.__closure__ or ()]
        first = adapter._first_batches
        source = next(c for c in cells if c is not first and hasattr(c, "__next__"))
    except (AttributeError, StopIteration, ValueError) as e:
        fail("validation_generator", e)
        return None

    def counted() -> Iterator:
        for batch in source:
            count()
            yield batch

    adapter.generator = lambda: itertools.chain(first, counted())
    return source, getattr(iterator, "steps_per_epoch", None)
