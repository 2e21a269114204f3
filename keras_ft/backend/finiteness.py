"""Whether a state holds a NaN or an infinity: the one place that decides.

A logged number (`finite_number`), an array on the host (`all_finite`), and
values on the device where they live (`finite_flag`, `device_all_finite`,
`non_finite_pieces`): one reduction there and one boolean read back, rather
than every value copied to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import ml_dtypes
import numpy as np

from keras_ft.backend import device_memory
from keras_ft.once import made_once


def non_finite_pieces(copies: list) -> set[int]:
    """The indices of `copies` (from `device_snapshot()`) of which a piece on
    this process's devices holds a NaN or an infinity; waits for the check
    (and for the steps queued before it).

    Each device checks what it holds, with one operation (no collective: a
    process that checks another way, or not at all, holds no other up). A
    piece held by another process only is that process's to check.
    """
    import jax

    by_device: dict[Any, list[tuple[int, Any]]] = {}
    for i, copy in enumerate(copies):
        if isinstance(copy, jax.Array) and _floating(copy):
            for shard in copy.addressable_shards:
                by_device.setdefault(shard.device, []).append((i, shard.data))
    flags = [
        (held, _jax_finite_each()([data for _, data in held]))
        for held in by_device.values()
    ]  # Launched on every device before any is read.
    return {
        i
        for held, finite in flags
        for (i, _), ok in zip(held, np.asarray(finite), strict=True)
        if not ok
    }


def _jax_finite_each() -> Callable[[list], Any]:
    def make() -> Any:
        import jax
        import jax.numpy as jnp

        return jax.jit(lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]))

    return made_once("jax_finite_each", make)


def device_all_finite(values: list) -> bool:
    """Whether `values` (Keras variables or backend tensors) hold no NaN or
    infinity, checked where they live: one reduction on the device, and one
    boolean read back, rather than every value copied to host memory (on a
    GPU that copy, at every batch, would cost more than the step)."""
    flag = finite_flag(values)
    if flag is None or bool(flag):
        return True
    if keras.backend.backend() == "torch":
        import torch

        # The flag sums each value: only an overflowing sum of finite values
        # needs the exact check.
        with torch.no_grad():
            tensors = [device_memory.raw_value(v) for v in values if _floating(v)]
            return all(bool(torch.isfinite(t).all()) for t in tensors)
    return False


def finite_flag(values: list) -> Any:
    """One boolean on the device, launched and not read: whether `values`
    hold no NaN or infinity (`None` where none is floating). Reading it
    waits for the reduction, and for the steps queued before it. On
    PyTorch it is the sums' (in float32 for narrower types): `False` also
    where a sum of finite values overflowed (`device_all_finite` is
    exact)."""
    tensors = [device_memory.raw_value(v) for v in values if _floating(v)]
    if not tensors:
        return None
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_all_finite()(tensors)
    if backend == "torch":
        import torch

        with torch.no_grad():
            sums = torch.stack(
                [torch.sum(t, dtype=torch.float32).reshape(()) for t in tensors]
            )
            return torch.isfinite(sums).all()
    if backend == "tensorflow":
        return _tf_all_finite()(tensors)
    return all(all_finite(np.asarray(t).reshape(-1)) for t in tensors)


def _floating(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    # A Keras variable's dtype is its name, a NumPy or JAX dtype has one;
    # the rest (PyTorch's, TensorFlow's) are named by Keras.
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if not isinstance(name, str) or isinstance(dtype, type):
        name = keras.backend.standardize_dtype(dtype)
    return name.startswith(("float", "bfloat"))


def _jax_all_finite() -> Callable[[list], Any]:
    def make() -> Any:
        import jax
        import jax.numpy as jnp

        # One executable for every value, one boolean out.
        return jax.jit(
            lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs]))
        )

    return made_once("jax_finite", make)


def _tf_all_finite() -> Callable[[list], Any]:
    def make() -> Any:
        import tensorflow as tf

        return tf.function(
            lambda xs: tf.reduce_all(
                tf.stack([tf.reduce_all(tf.math.is_finite(x)) for x in xs])
            ),
            reduce_retracing=True,
        )

    return made_once("tensorflow_finite", make)


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or infinity; other types always do.

    The sum of an array with a NaN or an infinity is not finite, and one
    pass of summing costs much less than `isfinite()` and its mask; only an
    overflowing sum of finite values needs the exact check.
    """
    if array.dtype.kind != "f" and array.dtype != ml_dtypes.bfloat16:
        return True
    accumulate = np.float32 if array.dtype.itemsize < 4 else None
    # An overflowing sum (or inf - inf) is an answer here, not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(array, dtype=accumulate)
    if np.isfinite(total):
        return True
    return bool(np.isfinite(array).all())


def finite_number(value: Any) -> bool:
    """Whether `value` (a loss or metric of `logs`) is a finite number. What
    is not a number at all is taken as finite: there is nothing to refuse."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True
