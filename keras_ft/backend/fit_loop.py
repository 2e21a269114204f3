"""How each backend's `fit()` loop calls `train_function`: the step a
resume skips (`skipped_step`), and whether the loop pulls its batches itself.
"""

from __future__ import annotations

from typing import Any

import keras


def skipped_step(
    args: tuple, logs: dict, count: int, pull: bool = True
) -> tuple[Any, list, Any]:
    """What a no-op `train_function(*args)` must pull and return.

    - TensorFlow: `train_function(iterator)`, the function pulls the batches;
    - JAX: `train_function(state, iterator)` returns `(logs, state)`;
    - PyTorch: `train_function(data)`, the loop has already pulled the batch.

    Args:
        pull: Whether to pull `count` batches (to draw them through the
            pipeline); not when the input skips them at its source.

    Returns:
        `(result, batches pulled, the iterator pulled from or None)`.
    """
    iterator = step_iterator(args)
    batches = _pull(iterator, count) if pull and iterator is not None else []
    if keras.backend.backend() == "jax":
        return (logs, args[0]), batches, iterator
    return logs, batches, iterator


def step_iterator(args: tuple) -> Any:
    """The data iterator a `train_function(*args)` pulls from, or `None`
    (PyTorch: the loop pulled the batch)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return args[0]
    if backend == "jax":
        return args[1]
    return None


def loop_pulls_batches() -> bool:
    """Whether `fit()` pulls every step's batches itself, before calling
    `train_function` (PyTorch): a step skipped at the input's source must
    then still be handed something."""
    return keras.backend.backend() == "torch"


def _pull(iterator: Any, count: int) -> list:
    batches = []
    for _ in range(count):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches
