"""SLURM for real: a controller and a node on 127.0.0.1, started and stopped
here; `sbatch` of examples/slurm_requeue.sh, a task SIGKILLed, the job
requeued, every process resuming from the chief's backup. Nothing exported
by hand: `keras_ft.initialize_cluster()` reads SLURM's own variables."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from conftest import TESTS_DIR, free_port, subprocess_env

from keras_ft.distribute.launch import launch_from_environment

ROOT = os.path.dirname(TESTS_DIR)
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun")
MUNGE_KEY = "/etc/munge/munge.key"


def _missing() -> str | None:
    """Why a SLURM cluster cannot be started here, or `None`."""
    absent = [d for d in DAEMONS if shutil.which(d, path=_path()) is None]
    if absent:
        return (
            f"{', '.join(absent)} not installed (Debian: apt-get install "
            "slurm-wlm munge; `make test` does where it can)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to start tasks as the test's user"
    if not os.path.exists(MUNGE_KEY):
        return f"no munge key at {MUNGE_KEY}"
    return None


def _path() -> str:
    return os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


SLURM_BACKENDS = pytest.mark.skipif(
    keras.backend.backend() not in ("tensorflow", "jax"),
    reason="SLURM runs TensorFlow's and JAX's multi-worker trainings",
)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster (munge, slurmctld, slurmd) in a directory of
    its own; the environment that points SLURM's commands at it."""
    why = _missing()
    if why is not None:
        pytest.skip(why)
    home = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log", "munge"):
        (home / sub).mkdir()
    node = socket.gethostname()
    conf = home / "slurm.conf"
    conf.write_text(
        f"""ClusterName=kerasft
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={home}/munge/socket,cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
MpiDefault=none
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd.pid
SlurmdSpoolDir={home}/spool
StateSaveLocation={home}/state
SlurmctldLogFile={home}/log/slurmctld.log
SlurmdLogFile={home}/log/slurmd.log
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=FORCE
"""
    )
    env = dict(subprocess_env(), SLURM_CONF=str(conf), PATH=_path())
    started = []

    def start(*command: str) -> None:
        subprocess.run(command, env=env, check=True, timeout=30)
        started.append(command[0])

    try:
        start(
            "munged", "--force", "-S", f"{home}/munge/socket",
            "--pid-file", f"{home}/munge/pid", "--log-file", f"{home}/log/munge",
        )  # fmt: skip
        start("slurmctld")
        start("slurmd", "-N", node)
        deadline = time.monotonic() + 60
        while "idle" not in _run(env, "sinfo", "-h", "-o", "%t"):
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-2000:] for p in (home / "log").iterdir())
                raise AssertionError(f"the SLURM node never came up:\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=30)
        for daemon, pidfile in (
            ("slurmd", home / "slurmd.pid"),
            ("slurmctld", home / "slurmctld.pid"),
            ("munged", home / "munge" / "pid"),
        ):
            if daemon in started and pidfile.exists():
                pid = int(pidfile.read_text())
                _stop(pid)


def _stop(pid: int) -> None:
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    # It may have exited between the last look and now.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


def _run(env: dict, *command: str) -> str:
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=30
    ).stdout


def _job(env: dict, job: str) -> dict[str, str]:
    shown = _run(env, "scontrol", "show", "job", "-o", job)
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def run_job(env: dict, out: str, *args: str, timeout: float = 420) -> dict:
    """`sbatch` examples/slurm_requeue.sh with `args`, from the repository
    (the job runs there); returns the job as `scontrol` shows it, once it
    has ended. SLURM holds a requeued job until the last attempt's
    credential expires (`cred_expire`: 120 s by default, 5 s here), so that
    the old attempt's late exit is never taken for the new one's (released
    by hand earlier, it was)."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", f"--output={out}",
         "examples/slurm_requeue.sh", *args],
        env=dict(env, PYTHON=sys.executable), cwd=ROOT, capture_output=True,
        text=True, timeout=30, check=True,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = _job(env, job)
        if shown.get("JobState") in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"
        ):  # fmt: skip
            return shown
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, timeout=30)
    with open(out) as f:
        raise AssertionError(f"job {job} did not end:\n{f.read()[-4000:]}")


@SLURM_BACKENDS
def test_a_task_killed_under_sbatch_is_requeued_and_resumes(slurm, tmp_path):
    """Worker 1 SIGKILLs itself at optimizer step 13 of the first attempt (the
    last backup at step 12): `srun --kill-on-bad-exit` ends the step, the
    script requeues the job, and both processes of the second attempt resume
    at step 12 and finish, with equal weights."""
    out = str(tmp_path / "job.out")
    backup, result = str(tmp_path / "backup"), str(tmp_path / "result")
    job = run_job(
        slurm, out, "--backup-dir", backup, "--kill-at", "13", "--out", result
    )
    with open(out) as f:
        printed = f.read()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", printed[-4000:]
    resumed = [line for line in printed.splitlines() if "resuming at" in line]
    assert len(resumed) == 2, printed[-4000:]
    # Both at one step: the chief's last commit before the kill, step 12, or
    # step 10 where srun ended the chief while it was committing step 12 (a
    # loaded machine).
    steps = {re.search(r"optimizer step (\d+)", line).group(1) for line in resumed}
    assert steps in ({"12"}, {"10"}), printed[-4000:]
    with np.load(f"{result}-0.npz") as a, np.load(f"{result}-1.npz") as b:
        assert int(a["step"]) == int(b["step"]) == 24
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_step_is_read_from_slurm_variables_alone():
    """What `srun -n 4` over two nodes sets (no MASTER_ADDR, no MASTER_PORT);
    a batch script outside `srun` is one process."""
    step = {
        "SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS": "4", "SLURM_RESTART_COUNT": "2",
    }  # fmt: skip
    launch = launch_from_environment(step)
    assert (launch.launcher, launch.rank, launch.world_size) == ("slurm", 3, 4)
    assert (launch.address, launch.single_host, launch.restart) == ("gpu07", False, 2)
    # The same ports in every process (and requeue) of the job.
    assert launch.port == launch_from_environment({**step, "SLURM_PROCID": "0"}).port
    # Below the ports the kernel hands to outbound connections, for any job.
    for job in ("0", "4242", "4095", "999999"):
        port = launch_from_environment({**step, "SLURM_JOB_ID": job}).port
        assert 16384 <= port <= 32768 - 4, (job, port)
    batch_script = {k: v for k, v in step.items() if not k.startswith("SLURM_STEP")}
    assert launch_from_environment(batch_script) is None
