"""Host memory, with as few copies as can be.

On the CPU, TensorFlow's tensors, JAX's arrays and PyTorch's tensors can all be
viewed as NumPy arrays in place (`view`); `keras.ops.convert_to_numpy()` copies
instead (and a TensorFlow variable's `numpy()` copies once more). A view is only
valid until the backend updates the variable, so callers copy it or write it
out before the next training step. The other way (`for_assign`), an array is
handed to a variable's `assign()` in the form that backend copies least: Keras'
own conversion copies it twice on TensorFlow.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

# The alignment TensorFlow's CPU kernels require of a tensor's data.
_TF_ALIGNMENT = 64


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

        if isinstance(value, tf.distribute.DistributedValues):
            value = value.read_value()  # A strategy's: its own read.
        elif isinstance(value, tf.Variable):
            # One op (`read_value()` adds an identity: two dispatches, a few
            # ms a save over a model's variables); the tensor read shares the
            # variable's buffer, which `numpy()` would copy.
            value = tf.raw_ops.ReadVariableOp(resource=value.handle, dtype=value.dtype)
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


def for_assign(array: np.ndarray) -> Any:
    """`array` as the value to pass to a Keras variable's `assign()`.

    On TensorFlow, a tensor with its own copy of the values, made in one
    copy (Keras converts an array by copying it, then copying the copy again
    if that is unaligned). On JAX, a JAX array sharing `array`'s memory
    (`assign()` keeps it as is; Keras' own conversion would copy). Elsewhere
    `array` itself: PyTorch copies it into the variable.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        # No copy: fresh pages cost more to fault in here than the disk
        # takes to read them. The file stays share-locked (not recycled)
        # while arrays alias it; training replaces every one of them.
        return jax.device_put(array, may_alias=True)
    if backend != "tensorflow":
        return array
    import tensorflow as tf

    # TensorFlow aborts the process on an unaligned DLPack tensor.
    if array.ctypes.data % _TF_ALIGNMENT or not array.flags.c_contiguous:
        return array
    try:
        shared = tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    except (TypeError, ValueError, RuntimeError, BufferError):
        return array  # E.g. bfloat16, which DLPack refuses.
    return tf.raw_ops.DeepCopy(x=shared)
