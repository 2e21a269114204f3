"""Who writes: this process's role in a cluster, and the directories it uses.

The chief commits checkpoints into `<backup_dir>/chief/`. Every other worker
takes part in a save where the backend needs all workers to read distributed
variables, but writes into its own `<backup_dir>/workertemp_<index>/`, removed
after each save. A single process is the chief.
"""

from __future__ import annotations

import dataclasses
import json
import os

_WORKER_TEMP_PREFIX = "workertemp_"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """This process's place in a training cluster.

    Attributes:
        task_type: `"chief"`, `"worker"`, `"evaluator"`, or `"process"` for a
            JAX or PyTorch process.
        task_index: Index of this task among those of its type.
        num_workers: Number of processes that train (chief included).
        is_chief: Whether this process commits checkpoints.
    """

    task_type: str = "chief"
    task_index: int = 0
    num_workers: int = 1
    is_chief: bool = True

    @classmethod
    def from_tf_config(cls, tf_config: str) -> TaskSpec:
        """Parses the `TF_CONFIG` environment variable's JSON text."""
        try:
            config = json.loads(tf_config)
        except ValueError as e:
            raise ValueError(
                f"The environment variable TF_CONFIG is not valid JSON ({e}). "
                f"Received: TF_CONFIG={tf_config!r}"
            ) from None
        if not isinstance(config, dict):
            raise ValueError(
                "The environment variable TF_CONFIG must be a JSON object with "
                f'"cluster" and "task" keys. Received: TF_CONFIG={tf_config!r}'
            )
        cluster = config.get("cluster", {})
        task = config.get("task", {})
        if not isinstance(cluster, dict) or not isinstance(task, dict):
            raise ValueError(
                'TF_CONFIG\'s "cluster" and "task" must be JSON objects. '
                f"Received: TF_CONFIG={tf_config!r}"
            )
        if not cluster and not task:
            return cls()
        task_type = task.get("type")
        task_index = task.get("index", 0)
        if not isinstance(task_type, str) or not isinstance(task_index, int):
            raise ValueError(
                'TF_CONFIG\'s "task" needs a string "type" and an integer '
                f'"index", e.g. {{"type": "worker", "index": 0}}. '
                f"Received: TF_CONFIG={tf_config!r}"
            )
        chiefs = len(cluster.get("chief", []))
        workers = len(cluster.get("worker", []))
        if task_type == "chief":
            is_chief = True
        elif task_type == "worker":
            # Without a "chief" task, worker 0 plays the chief, as in TF.
            is_chief = chiefs == 0 and task_index == 0
        else:
            is_chief = False
        return cls(task_type, task_index, max(1, chiefs + workers), is_chief)


def current_task() -> TaskSpec:
    """Detects this process's role from the running framework.

    In order: an active multi-worker `tf.distribute` strategy or `TF_CONFIG`
    (TensorFlow backend), `jax.process_index()` (JAX backend, several
    processes), `torch.distributed` once initialised. Otherwise a single chief.
    """
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        spec = _task_from_tf_strategy()
        if spec is not None:
            return spec
        if os.environ.get("TF_CONFIG"):
            return TaskSpec.from_tf_config(os.environ["TF_CONFIG"])
    elif backend == "jax":
        import jax

        if jax.process_count() > 1:
            index = jax.process_index()
            return TaskSpec("process", index, jax.process_count(), index == 0)
    elif backend == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            return TaskSpec("process", rank, dist.get_world_size(), rank == 0)
    return TaskSpec()


def _task_from_tf_strategy() -> TaskSpec | None:
    from keras_ft import compat

    found = compat.strategy_cluster()
    if found is None:
        return None
    task_type, task_index, spec = found
    chiefs, workers = len(spec.get("chief", [])), len(spec.get("worker", []))
    is_chief = task_type == "chief" or (
        task_type == "worker" and chiefs == 0 and task_index == 0
    )
    return TaskSpec(task_type, task_index, max(1, chiefs + workers), is_chief)


def worker_temp_name(task_index: int) -> str:
    """The name of the directory a non-chief worker writes a save into, to
    throw it away (beside the chief's directory, on a disk)."""
    return f"{_WORKER_TEMP_PREFIX}{task_index}"
