"""Fixes that let Keras 3 `model.fit()` run under `MultiWorkerMirroredStrategy`.

Keras 3 (checked on 3.15) fails before the first step when the TensorFlow
backend trains under a multi-worker `tf.distribute` strategy:

1. `TensorFlowTrainer._maybe_symbolic_build` reduces the first per-replica
   batch with `strategy.reduce(..., axis=None)`, which a collective strategy
   cannot do eagerly on a `PerReplica` ("Attempt to convert a value
   (PerReplica:...) with an unsupported type to a Tensor"). The build only
   needs the batch's shapes and dtypes, which this worker's first replica has.
2. `reduce_per_replica` averages a multi-worker result with
   `strategy.reduce("MEAN", v, axis=0)`, but the train step's results (loss
   and metrics) are scalars ("Invalid reduction dimension 0 for input with 0
   dimensions", Keras #20585, TensorFlow #72388). A scalar is averaged across
   replicas only (`axis=None`).

Both replacements call Keras' own code unchanged unless a multi-worker
collective strategy is active, so single-process training is untouched. On a
Keras version these fixes were not checked against, a multi-worker run stops
with an error that says so, unless `KERAS_FT_MULTI_WORKER_FIXES` is set to
`1` (apply them anyway) or `0` (run Keras as it is).
"""

from __future__ import annotations

import os
from typing import Any

import keras

# Keras (major, minor) versions checked to need, and to work with, the fixes.
CHECKED_KERAS_VERSIONS = ((3, 15),)
_ENV = "KERAS_FT_MULTI_WORKER_FIXES"
_installed = False


def install_multi_worker_fixes() -> None:
    """Installs the fixes (idempotent); a no-op off the TensorFlow backend.

    `keras_ft.BackupAndRestore` calls this when it is created. Call it
    yourself before `fit()` to train under `MultiWorkerMirroredStrategy`
    without the callback.
    """
    global _installed
    if _installed or keras.backend.backend() != "tensorflow":
        return
    from keras.src.backend.tensorflow import trainer

    original_build = trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = trainer.reduce_per_replica

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
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

    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica
    _installed = True


def _fix_applies(strategy: Any) -> bool:
    """Whether `strategy` is one Keras mishandles, and the fix may be used."""
    from keras.src.backend.tensorflow import trainer

    if not trainer._collective_all_reduce_multi_worker(strategy):
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
