"""Global random state: capture it, and put it back.

Covers the generators that `keras.utils.set_random_seed()` seeds and that
`fit()` draws from outside the model: Python's `random` (PyDataset shuffling),
NumPy's global generator (array shuffling on JAX), PyTorch's default generator
wherever PyTorch is imported (array shuffling on PyTorch, through
`RandomSampler`; a `DataLoader(shuffle=True)` on any backend) and its generators
on CUDA devices (an unseeded Dropout on a GPU), and Keras' global
`SeedGenerator`. Seed generators owned by layers are model state, saved with
the model (see `state.py`). TensorFlow's data pipeline seeds itself from the
global seed each epoch, so it needs nothing here.

A captured state is a dictionary of JSON values and NumPy arrays.

The generators fall in two groups. The data pipeline draws from Python's and
NumPy's (shuffles, augmentation in a PyDataset), possibly on a prefetching
thread. Training steps draw from Keras' global generator and, on the torch
backend, from PyTorch's (an unseeded Dropout takes
`torch.nn.functional.dropout`). `model_side()` names the second group. On
the other backends PyTorch's generator is the data side's: only a
`DataLoader` draws from it (its shuffle, and augmentation in its dataset),
on TensorFlow in a `tf.data` thread that loads ahead of training.
"""

from __future__ import annotations

import random
from typing import Any

import keras
import numpy as np

from keras_ft import compat
from keras_ft.backend import random_state
from keras_ft.state import generators


def capture() -> dict[str, Any]:
    """The current state of every global generator in use."""
    state = from_raw(capture_raw())
    seed_state = compat.keras_global_seed_state()
    if seed_state is not None:
        state["keras"] = keras.ops.convert_to_numpy(seed_state.value)
    torch_state = random_state.generator_state()
    if torch_state is not None:
        state["torch"] = torch_state
    cuda_states = random_state.device_generator_states()
    if cuda_states is not None:
        state["torch_cuda"] = cuda_states
    return state


def capture_raw() -> tuple[Any, Any]:
    """The data side's generators (Python's, NumPy's) as they give their
    state: a few microseconds, cheap enough for every item a pipeline loads.
    `from_raw()` makes it what `capture()` returns."""
    return random.getstate(), np.random.get_state()


def from_raw(raw: tuple[Any, Any]) -> dict[str, Any]:
    """What `capture_raw()` returned, as `capture()` gives it."""
    (version, internal, gauss), (name, keys, pos, has_gauss, cached) = raw
    return {
        # An array, not 625 numbers: a save walks every node of the tree.
        "python": [version, np.asarray(internal, dtype=np.uint32), gauss],
        "numpy": {
            "name": name,
            "keys": np.array(keys),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def model_side() -> tuple[str, ...]:
    """The generators the training steps draw from (see the module's
    docstring): what a resumed epoch sets as at the save once the batches
    trained before it are replayed."""
    if random_state.steps_draw_from_torch():
        return ("torch", "torch_cuda", "keras")
    return ("keras",)


def check(state: Any) -> None:
    """Raises `ValueError` unless every generator's state in `state` is one
    `apply()` can set: each is set first on a generator of its own, so that
    a backup's malformed state is found before any global one is changed.

    Args:
        state: What a backup holds where `capture()`'s result was saved.
    """
    generators.check(state)
    if "keras" in state:
        seed = state["keras"]
        current = compat.keras_global_seed_state()
        shape = (2,) if current is None else tuple(current.shape)
        if not generators.integers(seed) or seed.shape != shape:
            raise ValueError(
                f"Keras' global seed state is not integers of shape {shape}"
            )
    if "torch" in state:
        torch_state = state["torch"]
        if not isinstance(torch_state, np.ndarray) or torch_state.dtype != np.uint8:
            raise ValueError("PyTorch's generator state is not bytes")
        random_state.check_generator_state(torch_state)
    if "torch_cuda" in state:
        cuda_states = state["torch_cuda"]
        if not isinstance(cuda_states, list) or not all(
            isinstance(s, np.ndarray) and s.dtype == np.uint8 and s.ndim == 1
            for s in cuda_states
        ):
            raise ValueError("PyTorch's CUDA generator states are not bytes")
        random_state.check_device_generator_states(cuda_states)


def apply(state: dict[str, Any], only: tuple[str, ...] | None = None) -> None:
    """Sets the global generators named in `state` to their captured state.

    Args:
        state: From `capture()`.
        only: If given, the generators to set (keys of `state`, e.g.
            `model_side()`); the others are left as they are.
    """
    if only is not None:
        state = {k: v for k, v in state.items() if k in only}
    if "python" in state:
        random.setstate(generators.python_state(state["python"]))
    if "numpy" in state:
        np.random.set_state(generators.numpy_state(state["numpy"]))
    if "keras" in state:
        compat.set_keras_global_seed_state(np.asarray(state["keras"]))
    if "torch" in state:
        random_state.set_generator_state(state["torch"])
    if "torch_cuda" in state:
        random_state.set_device_generator_states(state["torch_cuda"])
