"""A Grain dataset that `fit()` reads, followed batch by batch.

Grain's iterators are checkpointable: `get_state()` is a few bytes of JSON
(for a `MapDataset`, the index of the next element), and `set_state()` puts
a new iterator where an old one was without loading what came before. The
view puts a Grain dataset of its own between the user's dataset and Keras'
conversion for the backend, whose iterator hands the state after each
batch it hands on to `after_batch`, and puts a resumed epoch's new iterator at the saved
state before it yields anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from keras_ft import events
from keras_ft.compat.registry import fail, register, usable
from keras_ft.compat.training import code_names


def _grain_in_use() -> bool:
    # Only a user of Grain has imported it: no import here for the others.
    return "grain" in sys.modules


def _adapter_type() -> type:
    from keras.src.trainers.data_adapters.grain_dataset_adapter import (
        GrainDatasetAdapter,
    )

    return GrainDatasetAdapter


@register(
    "grain_position",
    "a Grain dataset resumed mid-epoch draws the trained batches again",
    applies=_grain_in_use,
)
def _check_grain_position() -> bool:
    import grain
    import keras

    adapter = _adapter_type()
    needed = {"_dataset"}
    if not (
        needed <= code_names(adapter.get_jax_iterator)
        and needed <= code_names(adapter.get_tf_dataset)
        and needed <= code_names(adapter.get_torch_dataloader)
        and hasattr(grain, "IterDataset")
        and hasattr(grain, "DatasetIterator")
    ):
        return False
    if keras.backend.backend() == "tensorflow":
        from keras.src.backend.tensorflow.trainer import TFEpochIterator

        names = code_names(TFEpochIterator.__init__)
        return {"_distributed_dataset", "_distribute_strategy"} <= names
    return True


class GrainView:
    """The Grain dataset (`MapDataset` or `IterDataset`) of a `fit()`.

    Installs a dataset of its own as the adapter's for the fit (and, on
    TensorFlow, rebuilds the epoch iterator's `tf.data` pipeline over it,
    which Keras made before any callback ran).

    Args:
        epoch_iterator: `fit()`'s epoch iterator.
        adapter: Its `GrainDatasetAdapter`.
        after_batch: Called with the batches an iterator has handed on in
            the epoch and its state after them, as each is handed on.
    """

    def __init__(
        self,
        epoch_iterator: Any,
        adapter: Any,
        after_batch: Callable[[int, dict], None],
    ):
        import keras

        self._epoch_iterator, self._adapter = epoch_iterator, adapter
        self.dataset = adapter._dataset
        self.after_batch = after_batch
        self._pending: tuple[dict, int, bool] | None = None
        adapter._dataset = _followed(self.dataset, self)
        self._tf_dataset = None
        if keras.backend.backend() == "tensorflow":
            self._tf_dataset = epoch_iterator._distributed_dataset
            self._set_tf_dataset(adapter.get_tf_dataset())

    @classmethod
    def of(
        cls, epoch_iterator: Any, after_batch: Callable[[int, dict], None]
    ) -> GrainView | None:
        """A view of `epoch_iterator`'s Grain dataset, or `None` (another
        input, a `grain.DataLoader`, epochs that are not one pass of it, or
        an internal that moved)."""
        adapter = getattr(epoch_iterator, "data_adapter", None)
        if adapter is None or type(adapter).__name__ != "GrainDatasetAdapter":
            return None
        if not usable("grain_position"):
            return None
        import grain

        if type(adapter) is not _adapter_type() or not isinstance(
            adapter._dataset, (grain.MapDataset, grain.IterDataset)
        ):
            return None  # A DataLoader: Keras builds a new one from its parts.
        if getattr(epoch_iterator, "steps_per_epoch", None) is not None:
            return None  # One iterator runs across the epochs.
        try:
            return cls(epoch_iterator, adapter, after_batch)
        except Exception as e:
            fail("grain_position", e)
            return None

    def skip(self, state: dict, count: int, placeholders: bool) -> None:
        """Has the next iterator start from `state`, after the epoch's first
        `count` batches (or, if Grain refuses the state, draw them again).

        Args:
            placeholders: Hand an empty tuple on for each trained batch first
                (PyTorch's `fit()` pulls a batch for every step).
        """
        self._pending = (state, count, placeholders)

    def remove(self) -> None:
        """Gives the adapter (and the epoch iterator) their datasets back."""
        self._adapter._dataset = self.dataset
        if self._tf_dataset is not None:
            self._epoch_iterator._distributed_dataset = self._tf_dataset
            self._tf_dataset = None

    def _started(self, iterator: Any) -> tuple[int, int]:
        """Called by an iterator at its first `next()`: where in the epoch
        it starts, and how many placeholders it hands on first."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0, 0
        state, count, placeholders = pending
        try:
            iterator.set_state(state)
        except Exception as e:
            events.warn(
                "restore",
                "BackupAndRestore: Grain could not take the saved state of "
                f"the dataset's iterator ({type(e).__name__}: {e}); the "
                f"{count} batches of this epoch trained before the restart "
                "are drawn from it again (not trained).",
                stacklevel=2,
            )
            iterator.restart()
            for _ in range(count):
                next(iterator.parent)
        return count, count if placeholders else 0

    def _set_tf_dataset(self, dataset: Any) -> None:
        import tensorflow as tf

        if not isinstance(dataset, tf.distribute.DistributedDataset):
            strategy = self._epoch_iterator._distribute_strategy
            dataset = strategy.experimental_distribute_dataset(dataset)
        self._epoch_iterator._distributed_dataset = dataset


def _followed(dataset: Any, view: GrainView) -> Any:
    """`dataset` as a Grain `IterDataset` whose iterators `view` follows."""
    import grain

    class Followed(grain.IterDataset):
        def __iter__(self) -> Any:
            return FollowedIterator(iter(dataset))

    class FollowedIterator(grain.DatasetIterator):
        def __init__(self, parent: Any):
            parents = [parent] if isinstance(parent, grain.DatasetIterator) else []
            super().__init__(parents)
            self.parent = parent
            self._position: int | None = None
            self._placeholders = 0

        def restart(self) -> None:
            self.parent = iter(dataset)
            if isinstance(self.parent, grain.DatasetIterator):
                self._parents = (self.parent,)

        def __next__(self) -> Any:
            if self._position is None:
                self._position, self._placeholders = view._started(self)
            if self._placeholders:
                self._placeholders -= 1
                return ()  # No leaves: every Keras converts it as is.
            item = next(self.parent)
            self._position += 1
            view.after_batch(self._position, self.parent.get_state())
            return item

        def get_state(self) -> dict[str, Any]:
            return self.parent.get_state()

        def set_state(self, state: dict[str, Any]) -> None:
            self.parent.set_state(state)

    return Followed(dataset)
