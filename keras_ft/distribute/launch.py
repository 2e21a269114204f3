"""Starting a training cluster from what its launcher put in the environment.

A launcher that restarts a failed job (torchrun's TorchElastic, a SLURM job
requeued) tells each process its rank, the number of processes and a
coordinator's address (SLURM: its node list and job number, which JAX and
TensorFlow's `SlurmClusterResolver` read themselves). `initialize_cluster()`
reads them, as TensorLayer's `TaskSpec` read `TF_CONFIG`, and starts the
backend's cluster with bounds a restart needs: JAX's coordination service
with a 10 s heartbeat (its default, 100 s, keeps every survivor of a dead
peer waiting for over a minute) and a bounded shutdown barrier; TensorFlow's
`TF_CONFIG` for `MultiWorkerMirroredStrategy`. Framework differences are the
point of this module, as of `cluster.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from keras_ft import events
from keras_ft.distribute.cluster import TaskSpec, current_task

# The notice, once per process, of a JAX cluster started elsewhere than by
# initialize_cluster() (with JAX's default timeouts); moot once it started one.
_JAX_TIMEOUTS = ("cluster", "jax default timeouts")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a launcher said about this process.

    Attributes:
        launcher: `"torchrun"` or `"slurm"`.
        rank: This process's index, 0 to `world_size - 1`.
        world_size: How many processes train.
        address: The host the coordinator runs on (rank 0's).
        port: The launcher's own port there; keras-ft's services use the
            ports after it.
        single_host: Whether every process runs on this host.
        restart: How many times the launcher restarted the job.
    """

    launcher: str
    rank: int
    world_size: int
    address: str
    port: int
    single_host: bool
    restart: int


def launch_from_environment(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher's description of this process, or `None` if no launcher
    set one: torchrun, or a SLURM job step (`srun`, also inside `sbatch`)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            return None
        launcher, rank, size = "torchrun", env["RANK"], env["WORLD_SIZE"]
        local = env.get("LOCAL_WORLD_SIZE", size)
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        address, port = env["MASTER_ADDR"], env["MASTER_PORT"]
    elif "SLURM_PROCID" in env and "SLURM_JOB_ID" in env:
        # A step's own variables: a batch script outside `srun` is one
        # process, whatever the job's task count.
        size = env.get("SLURM_STEP_NUM_TASKS")
        if size is None:
            return None
        launcher, rank = "slurm", env["SLURM_PROCID"]
        nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_NODELIST", ""))
        address = env.get("MASTER_ADDR") or first_host(nodes)
        # Every process computes the same ports from the job's number.
        port = env.get("MASTER_PORT") or str(slurm_port(env["SLURM_JOB_ID"]))
        local = size if env.get("SLURM_STEP_NUM_NODES", "1") == "1" else "0"
        restart = env.get("SLURM_RESTART_COUNT", "0")
    else:
        return None
    try:
        launch = Launch(
            launcher, int(rank), int(size), address, int(port),
            int(local) == int(size), int(restart),
        )  # fmt: skip
    except ValueError:
        raise ValueError(
            f"keras-ft cannot read the {launcher} environment: RANK/WORLD_SIZE "
            "(or SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_JOB_ID), MASTER_PORT "
            "and the restart count must be integers. Received: "
            + ", ".join(
                f"{k}={env.get(k)!r}"
                for k in (
                    "RANK",
                    "WORLD_SIZE",
                    "SLURM_PROCID",
                    "SLURM_STEP_NUM_TASKS",
                    "SLURM_JOB_ID",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                )
                if k in env
            )  # fmt: skip
        ) from None
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(
            f"keras-ft: the {launcher} rank {launch.rank} is not below the number "
            f"of processes {launch.world_size}."
        )
    return launch


def first_host(nodes: str) -> str:
    """The first host of a SLURM node list (`"node[003-005,9],gpu1"` gives
    `"node003"`), as JAX reads it."""
    head = nodes.split(",", 1)[0] if "[" not in nodes.split(",", 1)[0] else None
    if head is not None:
        return head
    prefix, _, ranges = nodes.partition("[")
    return prefix + ranges.split(",", 1)[0].split("-", 1)[0].rstrip("]")


def slurm_port(job_id: str) -> int:
    """The port a SLURM job's keras-ft services start from, the same in
    every process of the job (and of its requeues), four ports a job: from
    16384 to 32767, below the range of ports the kernel gives outbound
    connections (Linux: 32768-60999 by default), where any connection on the
    host could take one before TensorFlow's worker listens there. (JAX's own
    SLURM ports are above it, from 61440.)"""
    return 16384 + int(job_id) % 2**12 * 4


def initialize_cluster(
    heartbeat_seconds: int = 10,
    shutdown_seconds: int = 60,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> TaskSpec:
    """Starts this process's part of a training cluster from its launcher.

    Call it first thing in a script run by `torchrun --nproc-per-node=N
    --max-restarts=K train.py` or by SLURM's `srun` (in an `sbatch` script or
    not), before any other JAX or TensorFlow call:

    - JAX: `jax.distributed.initialize()` with a `heartbeat_seconds`
      heartbeat and a `shutdown_seconds` shutdown barrier, and gloo
      collectives on CPU: under torchrun with rank 0 as coordinator (on
      `MASTER_PORT + 1`); under SLURM as JAX finds the job itself. Then
      `keras.distribution.set_distribution(keras.distribution.DataParallel())`.
    - TensorFlow: `TF_CONFIG` for `tf.distribute.MultiWorkerMirroredStrategy`:
      under torchrun, worker `i` on `MASTER_PORT + 1 + i` (one host; on
      several, set `TF_CONFIG` yourself); under SLURM, every task of the step
      on every host, from TensorFlow's `SlurmClusterResolver`. Then create the
      strategy.
    - PyTorch: nothing (Keras trains one process on this backend).

    Without a launcher in the environment it does nothing, unless the JAX
    cluster is given by the last three arguments (as to
    `jax.distributed.initialize()`, which it then calls with the bounds
    below).

    Args:
        heartbeat_seconds: JAX: how long a silent peer is waited for before
            every process is told it is gone. Defaults to `10`.
        shutdown_seconds: JAX: how long a process that is done waits for the
            others to be done too (one still writing its outputs after
            `fit()`, say) before JAX aborts it. A dead peer does not make
            anyone wait this long: its heartbeat's silence, or the error a
            collective raises (see `training/exits.py`), ends the others
            first. Defaults to `60`.
        coordinator_address: JAX: `"host:port"` of process 0's coordination
            service, instead of the launcher's. Give all three or none.
        num_processes: JAX: how many processes train.
        process_id: JAX: this process's index, 0 to `num_processes - 1`.

    Returns:
        This process's role (`keras_ft.TaskSpec`).
    """
    import keras

    backend = keras.backend.backend()
    explicit = (coordinator_address, num_processes, process_id)
    if any(value is not None for value in explicit):
        if None in explicit or backend != "jax":
            raise ValueError(
                "Invalid arguments for `initialize_cluster()`: "
                "`coordinator_address`, `num_processes` and `process_id` describe "
                "a JAX cluster and go together. Received: "
                f"coordinator_address={coordinator_address!r}, num_processes="
                f"{num_processes!r}, process_id={process_id!r} on the {backend} "
                "backend. On TensorFlow set TF_CONFIG instead."
            )
        launch = None
        coordinator, world_size, rank = explicit
    else:
        launch = launch_from_environment()
        if launch is None:
            return current_task()
        coordinator = f"{launch.address}:{launch.port + 1}"
        world_size, rank = launch.world_size, launch.rank
    native_slurm = (
        launch is not None
        and launch.launcher == "slurm"
        and "MASTER_ADDR" not in os.environ
    )
    if backend == "jax":
        # Under SLURM itself, JAX reads SLURM's variables.
        where = {} if native_slurm else {
            "coordinator_address": coordinator,
            "num_processes": world_size,
            "process_id": rank,
        }  # fmt: skip
        _start_jax(where, heartbeat_seconds, shutdown_seconds)
    elif native_slurm and backend == "tensorflow" and not os.environ.get("TF_CONFIG"):
        os.environ["TF_CONFIG"] = _tf_config_from_slurm(launch)
    elif (
        launch is not None
        and backend == "tensorflow"
        and not os.environ.get("TF_CONFIG")
    ):
        os.environ["TF_CONFIG"] = _tf_config_from_launch(launch)
    return current_task()


def _start_jax(where: dict, heartbeat_seconds: int, shutdown_seconds: int) -> None:
    """`jax.distributed.initialize(**where)` with bounded timeouts and gloo
    collectives on CPU."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        **where,
        heartbeat_timeout_seconds=heartbeat_seconds,
        shutdown_timeout_seconds=shutdown_seconds,
    )
    events.first_time(*_JAX_TIMEOUTS)  # keras-ft chose them: nothing to say.


def _tf_config_from_launch(launch: Launch) -> str:
    """`TF_CONFIG` for this process of a one-host launch (torchrun): worker
    `i` on `MASTER_PORT + 1 + i`."""
    if not launch.single_host:
        raise ValueError(
            f"keras-ft: {launch.launcher} runs processes on several hosts, and "
            "TensorFlow needs every worker's address, which the launcher does "
            "not give: set TF_CONFIG for each process."
        )
    workers = [
        f"{launch.address}:{launch.port + 1 + i}" for i in range(launch.world_size)
    ]
    task = {"type": "worker", "index": launch.rank}
    return json.dumps({"cluster": {"worker": workers}, "task": task})


def _tf_config_from_slurm(launch: Launch) -> str:
    """`TF_CONFIG` for this task of a SLURM step, from TensorFlow's own
    `SlurmClusterResolver` (every host of the step, by `scontrol`), on the
    job's ports (`slurm_port()`).

    The resolver pairs each task of a node with its GPUs and drops the tasks
    it has none for: on nodes without GPUs (SLURM's count, 0 without
    `--gpus`) it is told of one per task, and not to hide any (else it would
    run `nvidia-smi` and give an empty cluster).
    """
    import tensorflow as tf

    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    per_node = max(
        int(count.split("(")[0])
        for count in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split(",")
    )
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=launch.port + 1,
        gpus_per_node=gpus or per_node,
        gpus_per_task=None if gpus else 1,
        auto_set_gpu=gpus > 0,
    )
    return json.dumps(
        {
            "cluster": resolver.cluster_spec().as_dict(),
            "task": {"type": resolver.task_type, "index": resolver.task_id},
        }
    )


def warn_of_jax_default_timeouts(num_workers: int) -> None:
    """Warns once in a multi-process JAX run that `initialize_cluster()` did
    not start: JAX does not say which timeouts it was given, and its
    defaults keep the survivors of a dead peer waiting for minutes."""
    if num_workers <= 1:
        return
    import keras

    if keras.backend.backend() != "jax":
        return
    if not events.first_time(*_JAX_TIMEOUTS):
        return
    events.warn(
        "cluster",
        "keras-ft: jax.distributed was not started by "
        "keras_ft.initialize_cluster(). If it runs with JAX's defaults "
        "(heartbeat_timeout_seconds=100, shutdown_timeout_seconds=300), a dead "
        "or frozen process keeps every other one waiting for 100 s or more "
        "before the job can be restarted. Call keras_ft.initialize_cluster() "
        "instead, or pass jax.distributed.initialize(..., "
        "heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10) and "
        "filter this warning.",
        stacklevel=3,
    )
