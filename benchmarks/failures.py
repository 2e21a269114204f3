"""Failures of a job, end to end: how fast they are noticed, how fast the job
is back, and how much of the run's time was useful.

Three tables, each measured side by side in one run:

1. Detection: a 2-process cluster on 127.0.0.1 (`examples/multiworker_torchrun.py`,
   set up by `keras_ft.initialize_cluster()`) trains; worker 1 gets a fault
   (SIGKILL, SIGSTOP, or its main thread hangs for good); the seconds until
   worker 0 has left by itself, and its exit status. The worst of `--trials`.
   The hang is bounded by `stall_timeout` (here `--stall-timeout`, 10 s).
2. Relaunch: torchrun (`--max-restarts`) restarts the group after worker 1
   SIGKILLs itself; from the chief's goodput records, seconds from the new
   process's start to its first batch, and from the kill to that batch.
3. Goodput: one training (a single process), SIGKILLed every `--kill-every`
   seconds and relaunched until it finishes, with keras-ft's callback and
   with Keras' own `BackupAndRestore` (each at its defaults). Goodput is the
   wall time of the same process never killed and with no callback, over the
   wall time to finish under kills (relaunches included); keras-ft's own
   `keras-ft goodput` figure is shown beside it.

Usage:
    python benchmarks/failures.py                  # everything, kills every 120 s
    python benchmarks/failures.py --quick          # 1 trial, smaller, kills every 20 s
    python benchmarks/failures.py --only goodput --backend tensorflow
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multiworker_torchrun.py")


def env_for(backend: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONUNBUFFERED="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def has_checkpoint(backup_dir: str) -> bool:
    chief = os.path.join(backup_dir, "chief")
    return os.path.isdir(chief) and any(
        n.startswith("ckpt-") for n in os.listdir(chief)
    )


# 1. Detection.


def detect_once(backend: str, fault: str, stall_timeout: float) -> tuple[float, int]:
    backup = tempfile.mkdtemp(prefix="failures-")
    port = free_port()
    args = ["--epochs", "1000", "--seconds-per-batch", "0.05"]
    if fault == "hang":
        args += ["--block-at", "6", "--stall-timeout", str(stall_timeout)]
    processes, logs = [], []
    try:
        for rank in (0, 1):
            env = env_for(backend, RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
            logs.append(os.path.join(backup, f"worker-{rank}.log"))
            with open(logs[-1], "w") as log:  # A file: a pipe could fill up.
                processes.append(subprocess.Popen(
                    [sys.executable, EXAMPLE, "--backup-dir", backup, *args],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                ))  # fmt: skip
        deadline = time.monotonic() + 180
        while not has_checkpoint(backup):
            if time.monotonic() > deadline or processes[0].poll() is not None:
                raise RuntimeError(f"the cluster did not start ({backend})")
            time.sleep(0.05)
        if fault == "hang":  # From the moment worker 1 says it hangs.
            while "blocked at" not in read(logs[1]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker 1 did not hang ({backend})")
                time.sleep(0.05)
        else:
            processes[1].send_signal(getattr(signal, fault))
        started = time.monotonic()
        processes[0].wait(timeout=600)
        return time.monotonic() - started, processes[0].returncode
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(backup, ignore_errors=True)


def detection(backends: list[str], trials: int, stall_timeout: float) -> None:
    print(f"\n1. Detection: seconds until worker 0 leaves (worst of {trials})")
    print(f"{'fault on worker 1':<28}" + "".join(f"{b:>24}" for b in backends))
    for fault, label in [
        ("SIGKILL", "SIGKILL"),
        ("SIGSTOP", "SIGSTOP (frozen)"),
        ("hang", f"main thread hangs ({stall_timeout:g} s)"),
    ]:
        row = f"{label:<28}"
        for backend in backends:
            runs = [detect_once(backend, fault, stall_timeout) for _ in range(trials)]
            worst = max(seconds for seconds, _ in runs)
            codes = sorted({code for _, code in runs})
            row += f"{f'{worst:.1f} s, exit {codes}':>24}"
        print(row, flush=True)


# 2. Relaunch under torchrun.


def relaunch(backends: list[str]) -> None:
    from keras_ft.checkpoint.store import CheckpointStore
    from keras_ft.goodput import load_attempts

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    print("\n2. torchrun restarts the group after a SIGKILL (seconds)")
    header = f"{'backend':<12}{'relaunch -> 1st batch':>24}"
    print(header + f"{'last record -> 1st batch':>28}")
    for backend in backends:
        backup = tempfile.mkdtemp(prefix="failures-")
        try:
            done = subprocess.run(
                [torchrun, "--standalone", "--nproc-per-node=2", "--max-restarts=2",
                 EXAMPLE, "--backup-dir", backup, "--kill-at", "13", "--keep-backup"],
                capture_output=True, text=True, env=env_for(backend), timeout=600,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            attempts = load_attempts(CheckpointStore(os.path.join(backup, "chief")))
            first, second = attempts[0], attempts[1]
            back = second["samples"][0][0]
            print(
                f"{backend:<12}{back - second['process_start']:>24.1f}"
                f"{back - first['samples'][-1][0]:>28.1f}",
                flush=True,
            )
        finally:
            shutil.rmtree(backup, ignore_errors=True)


# 3. Goodput under periodic kills.

GOODPUT_WORKER = """
import sys, time
import keras, numpy as np
callback, backup = sys.argv[1], sys.argv[2]
epochs, samples = int(sys.argv[3]), int(sys.argv[4])
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(samples, 256)).astype("float32")
y = x[:, :1] * 2.0
model = keras.Sequential([keras.Input((256,))] + [
    keras.layers.Dense(1024, activation="relu") for _ in range(3)
] + [keras.layers.Dense(1)])
model.compile(keras.optimizers.Adam(1e-4), loss="mse")
callbacks = []
if callback == "keras-ft":
    import keras_ft
    # Kept at the end, for its goodput records.
    callbacks = [keras_ft.BackupAndRestore(backup, delete_checkpoint=False)]
elif callback == "keras":
    callbacks = [keras.callbacks.BackupAndRestore(backup)]
started = time.monotonic()
model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks)
print(f"trained {time.monotonic() - started:.3f}")
"""


def run_under_kills(
    backend: str, callback: str, work: list[str], kill_every: float
) -> tuple[float, int, float | None]:
    """Wall time to finish, kills, and keras-ft's own goodput figure."""
    backup = tempfile.mkdtemp(prefix="failures-")
    kills = 0
    started = time.monotonic()
    try:
        while True:
            process = subprocess.Popen(
                [sys.executable, "-c", GOODPUT_WORKER, callback, backup, *work],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env_for(backend),
            )  # fmt: skip
            try:
                out, err = process.communicate(timeout=kill_every)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                kills += 1
                if kills > 50:
                    raise RuntimeError(f"{callback}: no end after 50 kills") from None
                continue
            if process.returncode != 0:
                raise RuntimeError(err[-2000:])
            wall = time.monotonic() - started
            break
        figure = None
        if callback == "keras-ft":
            from keras_ft.checkpoint.store import CheckpointStore
            from keras_ft.goodput import load_attempts, summarize

            chief = os.path.join(backup, "chief")
            if os.path.isdir(chief):
                figure = summarize(load_attempts(CheckpointStore(chief))).goodput
        return wall, kills, figure
    finally:
        shutil.rmtree(backup, ignore_errors=True)


def goodput(backends: list[str], epochs: int, samples: int, kill_every: float) -> None:
    print(
        f"\n3. Goodput: {epochs} epochs of {samples} samples (2.4M parameters), "
        f"SIGKILL every {kill_every:g} s, relaunched until done"
    )
    work = [str(epochs), str(samples)]
    header = f"{'backend':<12}{'callback':<12}{'kills':>6}{'wall s':>9}{'goodput':>9}"
    print(header + f"{'keras-ft goodput':>18}")
    for backend in backends:
        # The ideal: the same process, never killed, with no callback.
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", GOODPUT_WORKER, "none", "-", *work],
            capture_output=True, text=True, env=env_for(backend), timeout=3600,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        ideal = time.monotonic() - started
        print(f"{backend:<12}{'(none)':<12}{0:>6}{ideal:>9.1f}{'100%':>9}", flush=True)
        for callback in ("keras-ft", "keras"):
            wall, kills, figure = run_under_kills(backend, callback, work, kill_every)
            own = f"{figure:.0%}" if figure is not None else "-"
            print(
                f"{backend:<12}{callback:<12}{kills:>6}{wall:>9.1f}"
                f"{ideal / wall:>9.0%}{own:>18}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", action="append", choices=["tensorflow", "jax"])
    parser.add_argument("--only", choices=["detection", "relaunch", "goodput"])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--stall-timeout", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=120.0)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=131072)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.kill_every = 1, 20.0
        args.epochs, args.samples = 4, 32768
    backends = args.backend or ["tensorflow", "jax"]
    if args.only in (None, "detection"):
        detection(backends, args.trials, args.stall_timeout)
    if args.only in (None, "relaunch"):
        relaunch(backends)
    if args.only in (None, "goodput"):
        goodput(backends, args.epochs, args.samples, args.kill_every)


if __name__ == "__main__":
    main()
