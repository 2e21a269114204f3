"""Backend tensors as NumPy arrays, without a copy where the backend allows.

The one place that knows how each backend hands out host memory. On the CPU,
TensorFlow's tensors, JAX's arrays and PyTorch's tensors can all be viewed as
NumPy arrays in place; `keras.ops.convert_to_numpy()` copies instead (and a
TensorFlow variable's `numpy()` copies once more). A view is only valid until
the backend updates the variable, so callers copy it or write it out before
the next training step.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


def view(value: Any) -> np.ndarray:
    """`value` (a Keras variable, backend tensor or array) as a NumPy array.

    Shares memory with `value` when it lives in host memory; otherwise (a GPU
    tensor, an unusual type) returns a copy.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, keras.Variable):
        value = value.value
    try:
        array = _view_of(value)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        array = None
    if array is None:
        array = keras.ops.convert_to_numpy(value)
    return np.asarray(array)


def _view_of(value: Any) -> np.ndarray | None:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if isinstance(value, tf.Variable):
            # A read shares the variable's buffer; `numpy()` would copy it.
            value = value.read_value()
        if isinstance(value, tf.Tensor):
            return np.asarray(value)
    elif backend == "jax":
        import jax

        if isinstance(value, jax.Array):
            return np.asarray(value)
    elif backend == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
    return None
