"""Variables split across processes (JAX, `keras.distribution.ModelParallel`),
and the few collectives a cluster's processes agree with."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

from keras_ft.backend import host_memory

# Variables split across processes (JAX, `keras.distribution.ModelParallel`).


def spans_processes(value: Any) -> bool:
    """Whether `value` is split across processes: none can read it whole.

    Only a JAX array sharded over devices of several processes is. One that
    is replicated on every device (data parallelism) is read from the local
    copy, as on one process.
    """
    if keras.backend.backend() != "jax":
        return False
    if isinstance(value, keras.Variable):
        value = value.value
    import jax

    return (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.is_fully_replicated
    )


def any_spans_processes(values: Iterable[Any]) -> bool:
    """Whether one of `values` is split across processes (`spans_processes()`).

    Asked at every save: in a single process (where none can be, and each
    variable's read costs a few microseconds) it looks at none of them.
    """
    if keras.backend.backend() != "jax":
        return False
    import jax

    if jax.process_count() == 1:
        return False
    return any(spans_processes(v) for v in values)


Bounds = tuple[tuple[int, ...], tuple[int, ...]]


def own_pieces(value: Any) -> list[tuple[Bounds, np.ndarray]]:
    """The pieces of `value` this process writes, as `((start, stop), view)`.

    A JAX array's pieces are the shards on this process's devices of which
    it holds the first replica (replica id 0), so that of all processes
    exactly one writes each piece. The views are valid until the variable
    changes. Other backends' values are one piece, the whole value.
    """
    return [(bounds, data) for bounds, data, first in held_pieces(value) if first]


def held_pieces(value: Any) -> list[tuple[Bounds, np.ndarray, bool]]:
    """Every distinct piece of `value` on this process's devices, as
    `((start, stop), view, first)`: `first` if this process holds its first
    replica (the pieces of `own_pieces()`). What this process needs to
    rebuild its slices by itself (a local tier)."""
    return [
        (bounds, data if isinstance(data, np.ndarray) else np.asarray(data), first)
        for bounds, data, first in held_shards(value)
    ]


def held_shards(value: Any) -> list[tuple[Bounds, Any, bool]]:
    """`held_pieces()` without reading them: a JAX array's pieces are its
    shards' arrays, on their devices; other backends' value is one piece, a
    NumPy view of it."""
    if isinstance(value, keras.Variable):
        value = value.value
    shape = tuple(value.shape)
    if keras.backend.backend() == "jax":
        import jax

        if isinstance(value, jax.Array):
            pieces: dict[Bounds, tuple[Any, bool]] = {}
            for shard in value.addressable_shards:
                bounds = _bounds(shard.index, shape)
                held = pieces.get(bounds)
                if held is None or (shard.replica_id == 0 and not held[1]):
                    data = held[0] if held is not None else shard.data
                    pieces[bounds] = (data, shard.replica_id == 0)
            return [(bounds, data, first) for bounds, (data, first) in pieces.items()]
    return [(((0,) * len(shape), shape), host_memory.view(value), True)]


def build_like(
    value: Any, shape: tuple[int, ...], read: Callable[[Bounds], np.ndarray]
) -> Any:
    """A value for `value`'s variable, laid out as `value` is.

    On JAX, each of this process's devices gets the slice its sharding
    assigns it, `read((start, stop))`; nothing else is read. Elsewhere the
    whole value is read.
    """
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "jax":
        import jax

        if isinstance(value, jax.Array):
            return jax.make_array_from_callback(
                shape, value.sharding, lambda index: read(_bounds(index, shape))
            )
    return host_memory.for_assign(read(((0,) * len(shape), tuple(shape))))


def bounds_needed(value: Any, shape: tuple[int, ...]) -> list[Bounds]:
    """The slices of `value`'s variable that `build_like()` reads here, each
    once, in the order it reads them."""
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "jax":
        import jax

        if isinstance(value, jax.Array):
            indices = value.sharding.addressable_devices_indices_map(shape)
            return list(dict.fromkeys(_bounds(i, shape) for i in indices.values()))
    return [((0,) * len(shape), tuple(shape))]


def sharding_text(value: Any) -> str:
    """How `value` is laid out, for people reading a checkpoint's index."""
    if isinstance(value, keras.Variable):
        value = value.value
    sharding = getattr(value, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return "whole"
    axes = ", ".join(f"{n}={s}" for n, s in dict(mesh.shape).items())
    return f"{spec} over mesh({axes})"


def collectives_scope(model: Any) -> contextlib.AbstractContextManager:
    """Where the processes' agreements about `model` run: the scope of the
    `tf.distribute.MultiWorkerMirroredStrategy` it was built under on
    TensorFlow (`fit()` may be called outside it), nothing to enter
    elsewhere."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        strategy = getattr(model, "distribute_strategy", None)
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return strategy.scope()
    return contextlib.nullcontext()


def coordinator_in_process_zero() -> bool:
    """Whether the cluster's coordination service runs inside process 0, so
    that the other processes abort once it is gone (JAX's); TensorFlow's
    workers coordinate among themselves."""
    return keras.backend.backend() == "jax"


def all_processes_agree(flag: bool) -> bool:
    """Whether `flag` is true in every process of a cluster (JAX's, a
    `MultiWorkerMirroredStrategy` in scope, a `torch.distributed` group).

    A collective: every process must call it, in the same order. One
    process returns `flag`.
    """
    return bool(np.all(_gather(int(bool(flag)))))


def same_in_all_processes(value: int) -> bool:
    """Whether every process of a cluster passes the same `value`.

    A collective, as `all_processes_agree()`.
    """
    values = _gather(int(value))
    return bool(np.all(values == values.flat[0]))


def least_in_all_processes(value: int) -> int:
    """The least `value` any process of a cluster passes.

    A collective, as `all_processes_agree()`.
    """
    return int(_gather(int(value)).min())


def first_process_value(value: int) -> int:
    """The `value` process 0 of a cluster passes, in every process.

    A collective, as `all_processes_agree()`.
    """
    return int(_gather(int(value)).flat[0])


def gathers_across_processes() -> bool:
    """Whether this process can reach the others' values: a JAX cluster, a
    `MultiWorkerMirroredStrategy` in scope (TensorFlow), or an initialised
    `torch.distributed` group (PyTorch); one process reaches its own."""
    backend = keras.backend.backend()
    if backend == "jax":
        return True  # jax.process_count() is 1 outside a cluster.
    if backend == "tensorflow":
        return _tf_cluster_strategy() is not None
    return _torch_group_size() > 0


def _tf_cluster_strategy() -> Any:
    """The `MultiWorkerMirroredStrategy` in scope, or `None`."""
    if "tensorflow" not in sys.modules:
        return None
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return strategy
    return None


def _torch_group_size() -> int:
    """The size of the initialised `torch.distributed` group, or 0."""
    if "torch" not in sys.modules:
        return 0
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_world_size()


def _gather(value: int) -> np.ndarray:
    """`value` from every process (just this one's, in one process)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        strategy = _tf_cluster_strategy()
        if strategy is not None:
            import tensorflow as tf

            # One value per replica, in replica order: a worker's replicas
            # repeat its value, which changes no least value or agreement.
            mine = strategy.experimental_distribute_values_from_function(
                lambda _: tf.constant([value], tf.int64)
            )
            return strategy.gather(mine, axis=0).numpy()
    elif backend == "torch":
        size = _torch_group_size()
        if size > 1:
            import torch
            import torch.distributed as dist

            cuda = dist.get_backend() == "nccl"  # NCCL gathers device tensors.
            tensor = torch.tensor([value], dtype=torch.int64)
            tensor = tensor.cuda() if cuda else tensor
            values = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(values, tensor)
            return np.asarray([int(v.item()) for v in values], np.int64)
    elif backend == "jax":
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            from keras_ft.compat import gather_ints

            # The coordination service's store: a millisecond, where an
            # all-gather is compiled and run.
            values = gather_ints(value)
            if values is not None:
                return values
            return np.asarray(multihost_utils.process_allgather(np.int64(value)))
    return np.asarray([value])


def _bounds(index: tuple, shape: tuple[int, ...]) -> Bounds:
    """A shard's index (a tuple of slices) as (start, stop) per dimension."""
    start, stop = [], []
    for part, size in zip(index, shape, strict=False):
        first, last, _ = part.indices(size)
        start.append(first)
        stop.append(last)
    # An index may leave out trailing dimensions: those are whole.
    for size in shape[len(index) :]:
        start.append(0)
        stop.append(size)
    return tuple(start), tuple(stop)
