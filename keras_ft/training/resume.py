"""Skip the batches of an interrupted epoch that were already trained.

`fit()` restarts an epoch at its first batch. To continue at batch `k`, the
model's `train_function` is replaced for the first `k` steps by one that takes
the batch from the data pipeline (so the pipeline, its shuffling and its
random draws advance exactly as before) without running the model, then hands
back the real one. This is the only place that knows how each backend's
`fit()` loop calls `train_function`:

- TensorFlow: `train_function(iterator)`, the function pulls the batches;
- JAX: `train_function(state, iterator)` returns `(logs, state)`;
- PyTorch: `train_function(data)`, the loop has already pulled the batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras

from keras_ft import compat


class FastForward:
    """Makes a model's next `steps` training steps no-ops that consume data.

    Args:
        model: The model being fitted; `make_train_function()` must have run.
        steps: Number of steps to skip.
        logs: The logs reported for each skipped step.
        on_done: Called once the last skipped step has been consumed.
        on_first_batch: Called with the first skipped batch, when the data
            pipeline hands it to `train_function` (TensorFlow, JAX).
    """

    def __init__(
        self,
        model: keras.Model,
        steps: int,
        logs: dict[str, float],
        on_done: Callable[[], None],
        on_first_batch: Callable[[Any], None] | None = None,
    ):
        self.model = model
        self.steps_per_execution = getattr(model, "steps_per_execution", 1) or 1
        self.remaining = steps
        self.logs = dict(logs)
        self.on_done = on_done
        self.on_first_batch = on_first_batch
        self.original = model.train_function
        self.backend = keras.backend.backend()
        model.train_function = self._skip

    @property
    def active(self) -> bool:
        return self.model.train_function == self._skip

    def remove(self) -> None:
        """Gives the model its real `train_function` back."""
        if self.active:
            self.model.train_function = self.original

    def _skip(self, *args: Any) -> Any:
        self.remaining -= self.steps_per_execution
        batches = []
        if self.backend == "tensorflow":
            batches = _pull(args[0], self.steps_per_execution)
        elif self.backend == "jax":
            batches = _pull(args[1], self.steps_per_execution)
        if batches and self.on_first_batch is not None:
            first, self.on_first_batch = self.on_first_batch, None
            if self.backend == "tensorflow" and compat.tf_dataset_reshuffles(args[0]):
                warnings.warn(
                    "BackupAndRestore: the tf.data pipeline reshuffles at every "
                    "iteration (`Dataset.shuffle()`), and a new process cannot "
                    "replay the interrupted epoch's order: the rest of this "
                    "epoch is trained on batches in another order. For an "
                    "exact resume pass NumPy arrays or a keras.utils.PyDataset "
                    "with fit(shuffle=True), or a tf.data pipeline that does "
                    "not reshuffle.",
                    stacklevel=2,
                )
            first(batches[0])
        if self.remaining <= 0:
            self.remove()
            self.on_done()
        if self.backend == "jax":
            return self.logs, args[0]
        return self.logs


def _pull(iterator: Any, count: int) -> list:
    batches = []
    for _ in range(count):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches
