"""Kill a worker of a local training cluster, relaunch it, watch it resume.

Launches N worker processes on 127.0.0.1 that train one small model together
with `keras_ft.BackupAndRestore`: under `tf.distribute.MultiWorkerMirroredStrategy`
(TensorFlow backend) or `keras.distribution.DataParallel` over
`jax.distributed` (JAX backend). Once the chief has committed a backup, it
SIGKILLs one worker at a random moment, stops the others as a cluster manager
would, relaunches all N, and prints where they resumed and how they finished:

    python examples/local_cluster.py --backend jax --workers 2
    python examples/local_cluster.py --backend tensorflow --workers 2 --json
    python examples/local_cluster.py --signal TERM   # a preemption notice

`--json` adds one line `RESULT {...}` with the numbers, for the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
SAMPLES, GLOBAL_BATCH = 128, 16


# Where `free_ports()` looks: below Linux's range of ephemeral ports
# (32768-60999 by default; other systems start at 49152), which the kernel
# never hands to an outbound connection. A port from that range, free when
# chosen, may be taken by any process's connection before the server that
# is to listen there starts ("Could not start gRPC server"). Above the ports
# `keras_ft.initialize_cluster()` gives SLURM jobs with small numbers.
PORTS = range(20000, 32768)


def free_ports(count: int, in_a_row: bool = False) -> list[int]:
    """`count` ports on 127.0.0.1 that no one held a moment ago, for servers
    that start later (see `PORTS`); `in_a_row`: `count` consecutive ones."""
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(1000):
        first = rng.randrange(PORTS.start, PORTS.stop - count)
        wanted = range(first, first + count) if in_a_row else [first]
        if any(p in ports for p in wanted) or not all(map(_bindable, wanted)):
            continue
        ports.extend(wanted)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports on 127.0.0.1 in {PORTS}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The worker: one process of the cluster.


def s3_server_recording(action: str) -> bytes:
    """Drives the request recorder of a local moto S3 server (the tests'),
    the one `AWS_ENDPOINT_URL` names: "reset-recording", "start-recording",
    "stop-recording" or "download-recording"."""
    import urllib.request

    url = f"{os.environ['AWS_ENDPOINT_URL']}/moto-api/recorder/{action}"
    method = "GET" if action == "download-recording" else "POST"
    with urllib.request.urlopen(urllib.request.Request(url, method=method)) as r:
        return r.read()


def checkpoint_reads(recording: bytes, names: list[str]) -> int:
    """How many objects of the checkpoints `names` a moto recording shows
    were read (GETs of `.../<name>/<file>`; listings and writes are not
    reads, nor are the reads of checkpoints being written)."""
    # Moto appends each request from the thread that served it, unlocked: a
    # large entry (an upload's body) may be cut by another's. A GET's entry
    # is small, written whole: each entry is decoded where it begins.
    text = recording.decode(errors="replace")
    decoder = json.JSONDecoder()
    count = 0
    start = text.find('{"headers"')
    while start != -1:
        try:
            request, _ = decoder.raw_decode(text, start)
        except ValueError:
            request = {"method": "cut", "url": ""}  # An upload's, cut.
        path = request["url"].split("://", 1)[-1].split("?", 1)
        if request["method"] == "GET" and len(path) == 1:
            count += any(f"/{name}/" in path[0] for name in names)
        start = text.find('{"headers"', start + 1)
    return count


def emit(kind: str, **fields) -> None:
    print("EVENT " + json.dumps({"kind": kind, **fields}), flush=True)


def join_cluster(
    index: int, workers: int, ports: list[int]
) -> contextlib.AbstractContextManager:
    """Makes this process worker `index` of a data-parallel cluster of
    `workers` on 127.0.0.1 (`ports`: TensorFlow's, one per worker; JAX's
    coordinator's, the first); returns the scope to build the model in."""
    if os.environ["KERAS_BACKEND"] == "tensorflow":
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                "task": {"type": "worker", "index": index},
            }
        )
        import tensorflow as tf

        return tf.distribute.MultiWorkerMirroredStrategy().scope()
    import keras_ft

    # jax.distributed with a 10 s heartbeat (JAX's
    # default keeps the survivors of a dead process waiting 100 s).
    keras_ft.initialize_cluster(
        coordinator_address=f"127.0.0.1:{ports[0]}",
        num_processes=workers,
        process_id=index,
    )
    import keras

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False)
    )
    return contextlib.nullcontext()  # No strategy scope on JAX.


def add_snapshot_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--snapshot",
        choices=["auto", "device", "host"],
        default="auto",
        help="BackupAndRestore's `snapshot`: where a save copies the state",
    )


def run_worker(args: argparse.Namespace) -> None:
    backend = os.environ["KERAS_BACKEND"]
    scope = join_cluster(args.index, args.workers, args.ports)
    import keras
    import numpy as np

    import keras_ft

    keras.utils.set_random_seed(7)
    with scope:
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    if backend == "tensorflow":
        import tensorflow as tf

        data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)}
    else:
        data = {"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": False}

    def step(model: keras.Model) -> int:
        return int(keras.ops.convert_to_numpy(model.optimizer.iterations))

    class Report(keras.callbacks.Callback):
        first = True

        def on_epoch_begin(self, epoch, logs=None):
            if self.first:
                self.first = False
                emit("resumed", epoch=epoch, step=step(self.model))

        def on_train_batch_end(self, batch, logs=None):
            # `self.model`, not `model`: on JAX it syncs the variables.
            emit("batch_end", step=step(self.model))
            time.sleep(args.seconds_per_batch)

    local = {}
    if args.local_dir:  # Each worker's own disk, as if on machines of their own.
        local = {
            "local_dir": os.path.join(args.local_dir, f"worker-{args.index}"),
            "local_save_freq": args.local_save_freq,
        }
    backup = keras_ft.BackupAndRestore(
        args.backup_dir,
        save_freq=args.save_freq,
        delete_checkpoint=False,
        snapshot=args.snapshot,
        **local,
    )
    model.fit(epochs=args.epochs, verbose=0, callbacks=[backup, Report()], **data)
    weights = b"".join(keras.ops.convert_to_numpy(v).tobytes() for v in model.weights)
    emit(
        "done",
        step=step(model),
        weights=hashlib.sha256(weights).hexdigest(),
        is_chief=keras_ft.current_task().is_chief,
    )


# The launcher: starts, kills and relaunches the workers.


class Worker:
    def __init__(self, index: int, args: argparse.Namespace, ports: list[int]):
        command = [
            sys.executable, __file__, "--worker", str(index),
            "--workers", str(args.workers), "--backup-dir", args.backup_dir,
            "--epochs", str(args.epochs), "--save-freq", str(args.save_freq),
            "--seconds-per-batch", str(args.seconds_per_batch),
            "--snapshot", args.snapshot, "--ports", *map(str, ports),
        ]  # fmt: skip
        if args.local_dir:
            command += ["--local-dir", args.local_dir,
                        "--local-save-freq", str(args.local_save_freq)]  # fmt: skip
        env = dict(os.environ, KERAS_BACKEND=args.backend, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(EXAMPLES_DIR), env.get("PYTHONPATH", "")]
        )
        self.index = index
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        for line in self.process.stdout:
            if line.startswith("EVENT "):
                self.events.append(json.loads(line[len("EVENT ") :]))

    def _read_stderr(self) -> None:
        self.stderr.extend(self.process.stderr)

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["kind"] == kind), None)

    def finish(self, timeout: float) -> int:
        """Waits for the process; kills it after `timeout` seconds."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        return code


def launch(args: argparse.Namespace) -> list[Worker]:
    ports = free_ports(args.workers if args.backend == "tensorflow" else 1)
    return [Worker(i, args, ports) for i in range(args.workers)]


def _store(backup_dir: str):
    sys.path.insert(0, os.path.dirname(EXAMPLES_DIR))
    from keras_ft.checkpoint.store import open_store  # Needs no backend.

    return open_store(backup_dir.rstrip("/") + "/chief")


def committed(backup_dir: str) -> list[str]:
    """The chief's committed checkpoints, on disk or in a bucket (a URL)."""
    return [c.name for c in _store(backup_dir).checkpoints()]


def newest_committed_step(backup_dir: str) -> int | None:
    found = _store(backup_dir).latest_good()
    return None if found is None else found[1]["step"]


def _chief_entries(backup_dir: str) -> list[str]:
    bucket = _store(backup_dir).storage
    if not hasattr(bucket, "fs"):
        return sorted(os.listdir(os.path.join(backup_dir, "chief")))
    bucket.fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in bucket.fs.ls(bucket.root))


def entries(path: str) -> list[str]:
    """The names in a directory, or under a prefix of a bucket."""
    bucket = _store(path).storage  # Of `path/chief`.
    if not hasattr(bucket, "fs"):
        return sorted(os.listdir(path))
    bucket.fs.invalidate_cache()  # Object storage: list the prefix.
    root = bucket.root.rsplit("/", 1)[0]
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in bucket.fs.ls(root))


def run_launcher(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    victim = args.kill_worker
    if victim is None:
        victim = rng.randrange(args.workers)
    say = (lambda *a: None) if args.quiet else print
    say(f"Launching {args.workers} workers ({args.backend}) on 127.0.0.1, "
        f"backing up to {args.backup_dir}")  # fmt: skip
    workers = launch(args)
    deadline = time.monotonic() + args.timeout
    while not committed(args.backup_dir):
        if time.monotonic() > deadline or any(
            w.process.poll() is not None for w in workers
        ):
            stderr = "".join(workers[0].stderr[-30:])
            for w in workers:
                w.finish(0)
            raise RuntimeError(f"no backup was committed; chief said:\n{stderr}")
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, args.kill_window))
    steps_seen = max((e["step"] for e in workers[victim].events), default=0)
    signum = signal.Signals["SIG" + args.signal]
    workers[victim].process.send_signal(signum)
    say(f"Sent {signum.name} to worker {victim} after step {steps_seen}.")
    others = {}
    for w in workers:
        if signum == signal.SIGTERM:
            # A preemption notice: every worker backs up the same step and exits.
            others[w.index] = w.finish(args.timeout)
        else:
            # The others fail or hang in a collective: a cluster manager stops them.
            others[w.index] = w.finish(args.survivor_timeout)
    if signum == signal.SIGTERM:
        say(f"Exit statuses: {others} (143 = stopped by SIGTERM after a backup).")
    committed_step = newest_committed_step(args.backup_dir)
    say(f"All workers stopped; the chief's newest committed backup is at step "
        f"{committed_step}. Relaunching.")  # fmt: skip
    if args.wipe_local_of is not None:  # That machine came back empty.
        shutil.rmtree(os.path.join(args.local_dir, f"worker-{args.wipe_local_of}"))
    before = committed(args.backup_dir)  # What a restore could read.
    if args.count_bucket_reads:
        s3_server_recording("reset-recording")
        s3_server_recording("start-recording")

    workers = launch(args)
    codes = [w.finish(args.timeout) for w in workers]
    reads = None
    if args.count_bucket_reads:
        s3_server_recording("stop-recording")
        reads = checkpoint_reads(s3_server_recording("download-recording"), before)
    resumed = [w.event("resumed") for w in workers]
    done = [w.event("done") for w in workers]
    # Why a relaunched worker failed: said, and kept for a test's message.
    failed = {
        w.index: "".join(w.stderr[-30:])
        for w, code in zip(workers, codes, strict=True)
        if code != 0
    }
    for index, tail in failed.items():
        say(f"worker {index} exited with {codes[index]}:\n" + tail)
    result = {
        "victim": victim,
        "signal": signum.name,
        "killed_after_step": steps_seen,
        "exit_codes_after_kill": others,
        "committed_step": committed_step,
        "bucket_reads_after_relaunch": reads,
        "exit_codes": codes,
        "resumed_steps": [r and r["step"] for r in resumed],
        "resumed_epochs": [r and r["epoch"] for r in resumed],
        "final_steps": [d and d["step"] for d in done],
        "weights": [d and d["weights"] for d in done],
        "chiefs": [d and d["is_chief"] for d in done],
        "backup_dir_entries": entries(args.backup_dir),
        "chief_entries": _chief_entries(args.backup_dir),
        "stderr_of_failed": failed,
    }
    if all(r is not None for r in resumed) and all(d is not None for d in done):
        same = "equal" if len(set(result["weights"])) == 1 else "DIFFERENT"
        say(f"Resumed at step {result['resumed_steps'][0]} (epoch "
            f"{result['resumed_epochs'][0] + 1}) on every worker; finished at "
            f"step {result['final_steps'][0]}; final weights {same} on all "
            f"{args.workers} workers.")  # fmt: skip
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=os.environ.get("KERAS_BACKEND", "jax"),
                        choices=["tensorflow", "jax"])  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--seconds-per-batch", type=float, default=0.05)
    parser.add_argument("--kill-window", type=float, default=1.0,
                        help="kill within this many seconds")  # fmt: skip
    parser.add_argument("--kill-worker", type=int)
    parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--survivor-timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--backup-dir")
    parser.add_argument(
        "--local-dir", help="a local tier: worker i's is <local-dir>/worker-i"
    )
    parser.add_argument("--local-save-freq", type=int, default=1)
    add_snapshot_argument(parser)
    parser.add_argument(
        "--wipe-local-of",
        type=int,
        help="empty this worker's local tier before relaunching",
    )
    parser.add_argument(
        "--count-bucket-reads",
        action="store_true",
        help="with a local moto S3 server: count the checkpoint objects the "
        "relaunch reads",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--worker", type=int, dest="index")
    parser.add_argument("--ports", type=int, nargs="*")
    args = parser.parse_args()
    if args.index is not None:
        run_worker(args)
        return
    temporary = args.backup_dir is None
    if temporary:
        args.backup_dir = tempfile.mkdtemp(prefix="keras-ft-cluster-")
    try:
        run_launcher(args)
    finally:
        if temporary:
            shutil.rmtree(args.backup_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
