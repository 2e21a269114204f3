"""Fixes that let Keras 3 `model.fit()` run under `MultiWorkerMirroredStrategy`.

Keras 3 (checked on 3.10 to 3.16) fails before the first step when the
TensorFlow backend trains under a multi-worker `tf.distribute` strategy:

1. The trainer's `_maybe_symbolic_build` reduces the first per-replica batch
   with `strategy.reduce(..., axis=None)`, which a collective strategy
   cannot do eagerly on a `PerReplica` ("Attempt to convert a value
   (PerReplica:...) with an unsupported type to a Tensor"). The build only
   needs the batch's shapes and dtypes, which this worker's first replica has.
2. `reduce_per_replica` averages a multi-worker result with
   `strategy.reduce("MEAN", v, axis=0)`, but the train step's results (loss
   and metrics) are scalars ("Invalid reduction dimension 0 for input with 0
   dimensions", Keras #20585, TensorFlow #72388). A scalar is averaged across
   replicas only (`axis=None`).

Both replacements call Keras' own code unchanged unless a multi-worker
collective strategy is active, so single-process training is untouched. The
trainer class is found by what it is (the class of `keras.Model`'s bases
that defines `_maybe_symbolic_build` in the TensorFlow trainer's module),
not by its name, which Keras 3.16 changed. On a Keras version these fixes
were not checked against, a multi-worker run stops with an error that says
so, unless `KERAS_FT_MULTI_WORKER_FIXES` is set to `1` (apply them anyway)
or `0` (run Keras as it is).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import keras

from keras_ft.compat.registry import fail, register, usable

# Keras (major, minor) versions checked to need, and to work with, the fixes.
CHECKED_KERAS_VERSIONS = ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14), (3, 15), (3, 16))
_ENV = "KERAS_FT_MULTI_WORKER_FIXES"
# Keras is patched once per process (every model built after uses the
# fixes): the attribute that marks its patched function.
_INSTALLED = "_keras_ft_fixes"


def _tensorflow_trainer() -> tuple[type, Any] | None:
    """The TensorFlow trainer class `keras.Model` derives from, and its module."""
    for cls in keras.Model.__mro__:
        module = sys.modules.get(cls.__module__)
        if (
            "_maybe_symbolic_build" in vars(cls)
            and cls.__module__.endswith("backend.tensorflow.trainer")
            and callable(getattr(module, "reduce_per_replica", None))
            and callable(getattr(module, "_collective_all_reduce_multi_worker", None))
        ):
            return cls, module
    return None


def _multi_worker_here() -> bool:
    """Whether this TensorFlow process is one of several workers: the
    strategy in scope says so, or `TF_CONFIG` lists several chiefs and
    workers (as `distribute.cluster.current_task()` reads them; asked here,
    below it, without importing it)."""
    if keras.backend.backend() != "tensorflow":
        return False
    if strategy_cluster() is not None:
        return True
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster")
    except (ValueError, AttributeError):
        return False  # Malformed: `current_task()` names what is wrong.
    if not isinstance(cluster, dict):
        return False
    members = [cluster.get(kind) for kind in ("chief", "worker")]
    return sum(len(m) for m in members if isinstance(m, list)) > 1


@register(
    "multi_worker_fixes",
    "training under MultiWorkerMirroredStrategy fails inside Keras before "
    "the first step (Keras #20585)",
    applies=_multi_worker_here,
)
def _check_multi_worker_fixes() -> bool:
    return _tensorflow_trainer() is not None


def install_multi_worker_fixes_if_needed() -> None:
    """Installs the fixes in a process that is one of several TF workers."""
    if _multi_worker_here():
        install_multi_worker_fixes()


def install_multi_worker_fixes() -> None:
    """Installs the fixes (idempotent); a no-op off the TensorFlow backend.

    `keras_ft.BackupAndRestore` calls this when it is created in a process
    that `TF_CONFIG` or a `tf.distribute` strategy makes one of several
    workers. Call it yourself before `fit()` to train under
    `MultiWorkerMirroredStrategy` without the callback.
    """
    if keras.backend.backend() != "tensorflow":
        return
    if not usable("multi_worker_fixes"):
        return
    trainer, module = _tensorflow_trainer()
    if getattr(module.reduce_per_replica, _INSTALLED, False):
        return  # Keras' own functions carry the mark of the fixes.
    original_build = trainer._maybe_symbolic_build
    original_reduce = module.reduce_per_replica

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = getattr(self, "_distribute_strategy", None)
        if iterator is None or strategy is None or not _fix_applies(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            data_batch = keras.tree.map_structure(
                lambda v: _first_local_value(strategy, v), next(it)
            )
            break
        return original_build(self, data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and _fix_applies(strategy):
            return keras.tree.map_structure(
                lambda v: _mean_across_replicas(strategy, v, original_reduce),
                values,
            )
        return original_reduce(values, strategy, reduction)

    setattr(reduce_per_replica, _INSTALLED, True)
    trainer._maybe_symbolic_build = _maybe_symbolic_build
    module.reduce_per_replica = reduce_per_replica


def _fix_applies(strategy: Any) -> bool:
    """Whether `strategy` is one Keras mishandles, and the fix may be used."""
    _, module = _tensorflow_trainer()
    if not module._collective_all_reduce_multi_worker(strategy):
        return False
    setting = os.environ.get(_ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    if keras_version() in CHECKED_KERAS_VERSIONS:
        return True
    checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_KERAS_VERSIONS)
    raise RuntimeError(
        f"Keras {keras.__version__} has not been checked with keras-ft's fixes "
        f"for training under MultiWorkerMirroredStrategy (checked: Keras "
        f"{checked}). Set the environment variable {_ENV}=1 to apply them "
        f"anyway, or {_ENV}=0 if this Keras version trains under the strategy "
        "without them."
    )


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def _first_local_value(strategy: Any, value: Any) -> Any:
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _mean_across_replicas(strategy: Any, value: Any, original_reduce: Any) -> Any:
    local = _first_local_value(strategy, value)
    if getattr(local, "shape", None) is not None and local.shape.rank == 0:
        return strategy.reduce("MEAN", value, axis=None)
    return original_reduce(value, strategy, "mean")


def _under_tf_strategy() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return tf.distribute.has_strategy()


@register(
    "tf_strategy_cluster",
    "a process's role under a tf.distribute strategy is read from TF_CONFIG "
    "only, not from the strategy's cluster resolver",
    applies=_under_tf_strategy,
)
def _check_tf_strategy_cluster() -> bool:
    from tensorflow.python.distribute import collective_all_reduce_strategy as car

    return callable(car.CollectiveAllReduceExtended._in_multi_worker_mode)


def strategy_cluster() -> tuple[str, int, dict] | None:
    """`(task type, task index, cluster spec)` of the `tf.distribute` strategy
    in scope, if it runs several workers; else (or unknown) `None`."""
    if not _under_tf_strategy() or not usable("tf_strategy_cluster"):
        return None
    import tensorflow as tf

    extended: Any = tf.distribute.get_strategy().extended
    try:
        in_multi_worker = getattr(extended, "_in_multi_worker_mode", None)
        if in_multi_worker is None or not in_multi_worker():
            return None
        resolver = getattr(extended, "_cluster_resolver", None)
        if resolver is None:
            return None
        spec = resolver.cluster_spec().as_dict()
        return resolver.task_type, resolver.task_id or 0, spec
    except Exception as e:  # A moved internal: TF_CONFIG still says.
        fail("tf_strategy_cluster", e)
        return None
