"""A cluster set up from its launcher's environment, and brought back by
torchrun after a worker dies."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest
from conftest import TESTS_DIR, free_ports, subprocess_env

from keras_ft import events
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute import launch
from keras_ft.distribute.launch import (
    Launch,
    initialize_cluster,
    launch_from_environment,
)
from keras_ft.training import restarts
from keras_ft.training.watchdog import RETRYABLE_EXIT_CODE

EXAMPLE = os.path.join(
    os.path.dirname(TESTS_DIR), "examples", "multiworker_torchrun.py"
)

TORCHRUN = {
    "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "3",
}  # fmt: skip


def test_torchrun_and_slurm_environments_are_read():
    assert launch_from_environment(TORCHRUN) == Launch(
        "torchrun", 1, 2, "127.0.0.1", 29500, True, 3
    )
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_JOB_ID": "7", "SLURM_STEP_NUM_NODES": "2",
             "MASTER_ADDR": "node1", "MASTER_PORT": "6000"}  # fmt: skip
    assert launch_from_environment(slurm) == Launch(
        "slurm", 0, 4, "node1", 6000, False, 0
    )
    assert launch_from_environment({}) is None
    assert launch_from_environment({"RANK": "0", "WORLD_SIZE": "2"}) is None


@pytest.mark.parametrize(
    "change", [{"RANK": "one"}, {"RANK": "2"}, {"MASTER_PORT": "x"}]
)
def test_a_malformed_launcher_environment_is_named(change):
    with pytest.raises(ValueError, match="torchrun"):
        launch_from_environment({**TORCHRUN, **change})


def test_a_partly_given_jax_cluster_is_named():
    with pytest.raises(ValueError, match="process_id=None"):
        initialize_cluster(coordinator_address="127.0.0.1:1234", num_processes=2)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's timeouts")
def test_a_jax_cluster_started_elsewhere_is_warned_of_once(monkeypatch):
    """JAX does not say which timeouts it was started with: a cluster that
    `initialize_cluster()` did not start may have the 100 s heartbeat."""
    monkeypatch.setattr(events, "_said", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.warn_of_jax_default_timeouts(1)  # One process: no cluster.
    with pytest.warns(UserWarning, match="heartbeat_timeout_seconds=100"):
        launch.warn_of_jax_default_timeouts(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.warn_of_jax_default_timeouts(2)  # Once per process.
        monkeypatch.setattr(events, "_said", set())
        events.first_time("cluster", "jax default timeouts")  # initialize_cluster()
        launch.warn_of_jax_default_timeouts(2)


def test_a_restart_that_resumes_where_the_last_one_did_says_so(tmp_path):
    store = CheckpointStore(str(tmp_path))
    assert restarts.check_progress(store, 0, 0) is None
    assert restarts.check_progress(store, 1, 12) is None  # Progress: 0 -> 12.
    with pytest.warns(UserWarning, match="restart 2 resumes at optimizer step 12"):
        said = restarts.check_progress(store, 2, 12)
    assert "as restart 1 did" in said
    assert restarts.check_progress(store, 3, 14) is None


def torchrun(backup_dir: str, out: str, *args: str) -> subprocess.CompletedProcess:
    """torchrun on one host with its master port chosen here, not by
    `--standalone`: the example's workers listen on the next ports, which
    another suite running beside this one may hold."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return subprocess.run(
        [torchrun, "--nnodes=1", "--nproc-per-node=2", "--max-restarts=2",
         "--master-addr=127.0.0.1", f"--master-port={master_port()}",
         EXAMPLE, "--backup-dir", backup_dir, "--out", out, *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip


@pytest.mark.skipif(
    keras.backend.backend() not in ("tensorflow", "jax"),
    reason="multi-worker training is tested on TensorFlow and JAX",
)
def test_torchrun_restarts_the_group_and_the_run_ends_as_an_uninterrupted_one(
    tmp_path,
):
    """Worker 1 is SIGKILLed at step 13 (the last backup at step 12): torchrun
    stops worker 0 (or sees it exit with 75) and starts both again; they
    resume at step 12 and end with the weights of a run that was never
    killed."""
    killed = torchrun(str(tmp_path / "a"), str(tmp_path / "killed"), "--kill-at", "13")
    assert killed.returncode == 0, killed.stderr[-3000:]
    # torchrun saw the SIGKILL, or first the survivor's retryable exit (on
    # JAX, gloo's error reaches it within 0.1 s).
    failures = ("exitcode: -9", f"exitcode: {RETRYABLE_EXIT_CODE}")
    assert any(failure in killed.stderr for failure in failures), killed.stderr
    resumed = [x for x in killed.stdout.splitlines() if "resuming at" in x]
    assert len(resumed) == 2 and all("optimizer step 12" in x for x in resumed)
    whole = torchrun(str(tmp_path / "b"), str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    for rank in (0, 1):
        with (
            np.load(tmp_path / f"killed-{rank}.npz") as a,
            np.load(tmp_path / f"whole-{rank}.npz") as b,
        ):
            assert int(a["step"]) == int(b["step"]) == 24
            for name in b.files:
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)


CLUSTER_BACKENDS = pytest.mark.skipif(
    keras.backend.backend() not in ("tensorflow", "jax"),
    reason="the coordination services of TensorFlow and JAX",
)


def master_port() -> int:
    """A free `MASTER_PORT` whose next two ports are free too: the example
    puts JAX's coordinator on `MASTER_PORT + 1` and TensorFlow's workers on
    `MASTER_PORT + 1 + rank`, and another suite may hold any of them."""
    return free_ports(3, in_a_row=True)[0]


def start_pair(backup_dir: str, *args: str) -> list[subprocess.Popen]:
    """Two processes of the example as torchrun would start them (without
    its agent), once the chief has committed a backup."""
    port = master_port()
    processes = []
    for rank in (0, 1):
        env = subprocess_env()
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        processes.append(subprocess.Popen(
            [sys.executable, EXAMPLE, "--backup-dir", backup_dir,
             "--epochs", "100", "--seconds-per-batch", "0.1", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        ))  # fmt: skip
    chief = os.path.join(backup_dir, "chief")
    deadline = time.monotonic() + 120
    while not (os.path.isdir(chief) and any(
        n.startswith("ckpt-") for n in os.listdir(chief)
    )):  # fmt: skip
        if time.monotonic() > deadline or processes[0].poll() is not None:
            for process in processes:
                process.kill()
            raise AssertionError(processes[0].communicate()[0][-3000:])
        time.sleep(0.1)
    return processes


@CLUSTER_BACKENDS
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_frozen_peer_ends_the_other_process_within_15_s(tmp_path, fault):
    """Set up by `initialize_cluster()` (10 s heartbeat; JAX's default is
    100 s), the surviving process leaves by itself, with the retryable status
    (75) when the framework raises an error, or JAX's abort (SIGABRT) when its
    coordination service ends the process first (a frozen peer)."""
    processes = start_pair(str(tmp_path / "b"))
    try:
        processes[1].send_signal(fault)
        started = time.monotonic()
        out, _ = processes[0].communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        for process in processes:
            process.kill()
    expected = {RETRYABLE_EXIT_CODE}
    if keras.backend.backend() == "jax" and fault == signal.SIGSTOP:
        expected = {RETRYABLE_EXIT_CODE, -signal.SIGABRT}
    assert processes[0].returncode in expected, out[-3000:]
    assert took < 15, f"the surviving process took {took:.1f} s to leave"


@CLUSTER_BACKENDS
def test_a_stuck_worker_ends_the_whole_job_with_the_retryable_status(tmp_path):
    """Worker 1's main thread hangs for good in a callback (alive, its
    runtime heart-beating); worker 0 waits in the collective. Both leave with
    status 75 once no batch has ended for `stall_timeout`."""
    processes = start_pair(
        str(tmp_path / "b"), "--block-at", "6", "--stall-timeout", "5"
    )
    try:
        outs = [process.communicate(timeout=90)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert "worker 1: blocked at optimizer step 6" in outs[1]
    for process, out in zip(processes, outs, strict=True):
        assert process.returncode == RETRYABLE_EXIT_CODE, out[-3000:]
    assert "no batch ended" in outs[1], outs[1][-3000:]


@CLUSTER_BACKENDS
def test_sigterm_ends_a_worker_blocked_in_a_collective(tmp_path):
    """Worker 1 hangs, so worker 0 is blocked inside a collective where no
    Python handler runs; the scheduler's SIGTERM still ends it within its
    grace period, saying that no final backup was written."""
    processes = start_pair(
        str(tmp_path / "b"), "--block-at", "6", "--stall-timeout", "300",
        "--grace-period", "3",
    )  # fmt: skip
    try:
        time.sleep(2)  # Worker 0 is in the step after 6 by now.
        processes[0].send_signal(signal.SIGTERM)
        started = time.monotonic()
        out = processes[0].communicate(timeout=60)[0]
        took = time.monotonic() - started
    finally:
        for process in processes:
            process.kill()
    assert processes[0].returncode == 128 + signal.SIGTERM, out[-3000:]
    assert 3 <= took < 15, took
    assert "without a final backup" in out, out[-3000:]
