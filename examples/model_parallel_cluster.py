"""Model-parallel JAX training on a local cluster: sharded backups, kills, resharding.

Launches N JAX processes on 127.0.0.1 (each with D CPU devices, through
`XLA_FLAGS=--xla_force_host_platform_device_count`) that train one model under
`keras.distribution.ModelParallel`, its Dense kernels split across the devices
of all processes, with `keras_ft.BackupAndRestore`. Each process writes only
the pieces of the variables it holds; the chief commits. Run it again with
another `--processes` or `--devices` on the same `--backup-dir` to see the
backup restored onto another layout:

    cd examples
    python model_parallel_cluster.py --processes 4 --epochs 1 --backup-dir /tmp/mp
    python model_parallel_cluster.py --processes 2 --devices 2 --epochs 2 \
        --backup-dir /tmp/mp
    python model_parallel_cluster.py --processes 2 --kill-after-commit

`--kill-after-commit` SIGKILLs one process once a backup is committed, stops
the others as a cluster manager would, and relaunches them all. `--json` adds
one line `RESULT {...}` with the numbers, for the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from local_cluster import (
    EXAMPLES_DIR,
    add_snapshot_argument,
    checkpoint_reads,
    emit,
    free_ports,
    s3_server_recording,
)

SAMPLES, BATCH, FEATURES = 128, 16, 16


def run_worker(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax

    if args.processes > 1:
        import keras_ft

        # jax.distributed with a 10 s heartbeat (JAX's
        # default keeps the survivors of a dead process waiting 100 s).
        keras_ft.initialize_cluster(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.index,
        )
    import keras
    import numpy as np
    from jax.experimental import multihost_utils

    import keras_ft

    devices = jax.devices()
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices=devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    # Hidden layers split by columns, the output layer by rows: every
    # kernel is split across the devices of every process.
    layout_map[".*hidden.*kernel"] = (None, "model")
    layout_map[".*hidden.*bias"] = ("model",)
    layout_map[".*output.*kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False
        )
    )
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(args.units, activation="relu", name="hidden_1"),
            keras.layers.Dense(args.units, activation="relu", name="hidden_2"),
            keras.layers.Dense(4, name="output"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x[:, :4] * 2.0).astype("float32")

    def digest(model: keras.Model) -> str:
        # Gathered to every process: only for this example's small model.
        values = model.weights + model.optimizer.variables
        h = hashlib.sha256()
        for v in values:
            h.update(np.asarray(multihost_utils.process_allgather(v.value, tiled=True)))
        return h.hexdigest()

    def step(model: keras.Model) -> int:
        return int(keras.ops.convert_to_numpy(model.optimizer.iterations))

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # `self.model`, not `model`: on JAX it syncs the variables.
            emit("resumed", step=step(self.model), digest=digest(self.model))

        def on_train_batch_end(self, batch, logs=None):
            emit("batch_end", step=step(self.model))
            time.sleep(args.seconds_per_batch)

    class SaveMemory(keras.callbacks.Callback):
        """The process's peak resident memory during a save, above what it
        held before (Linux: the high-water mark, reset before each save).
        One of these goes before the backup callback, one after."""

        peak = 0

        def __init__(self, before: bool):
            super().__init__()
            self.before = before

        def on_train_batch_end(self, batch, logs=None):
            if self.before:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # Resets VmHWM to the current VmRSS.
                SaveMemory.base = memory("VmRSS")
            else:
                extra = memory("VmHWM") - SaveMemory.base
                SaveMemory.peak = max(SaveMemory.peak, extra)

    class HoldMoves(keras.callbacks.Callback):
        """Holds each save's move to host memory back for a while (the
        move waits its turn in the training's one mover thread), so that
        the steps after a save run before it: what a slow device-to-host
        link does. Goes before the backup callback."""

        def on_train_batch_end(self, batch, logs=None):
            from keras_ft import threads

            # The training's own pools (internal: this only slows it down).
            mover = backup._state._state.pools.mover
            threads.submit(mover, time.sleep, args.hold_moves)

    class Poison(keras.callbacks.Callback):
        """At step `--poison-at-step`, writes NaN into the piece of the first
        hidden kernel that only the last process holds: as a fault on one
        host would. Every process assigns the same global value (a JAX
        array spanning processes is set by all of them together). Goes
        before the backup callback."""

        def on_train_batch_end(self, batch, logs=None):
            if step(self.model) != args.poison_at_step:
                return
            kernel = self.model.get_layer("hidden_1").kernel
            value = np.array(
                multihost_utils.process_allgather(kernel.value, tiled=True)
            )
            last = args.processes - 1
            for device, index in kernel.value.sharding.devices_indices_map(
                value.shape
            ).items():
                if device.process_index == last:
                    value[index] = np.nan
            # Made from each process's own pieces: `device_put` of a global
            # value compares it across processes, and NaN equals nothing.
            kernel.assign(
                jax.make_array_from_callback(
                    value.shape, kernel.value.sharding, lambda index: value[index]
                )
            )

    local = {}
    if args.local_dir:  # Each process's own disk, as if on hosts of their own.
        local = {
            "local_dir": os.path.join(args.local_dir, f"process-{args.index}"),
            "local_save_freq": args.local_save_freq,
        }
    backup = keras_ft.BackupAndRestore(
        args.backup_dir,
        **local,
        save_freq=args.save_freq or "epoch",
        delete_checkpoint=False,
        verbose=0,
        # Measured saves are written before the batch ends: all of their
        # memory is seen between the two probes.
        async_save=not args.measure_memory,
        snapshot=args.snapshot,
    )
    callbacks = [backup, Report()]
    if args.hold_moves:
        callbacks.insert(0, HoldMoves())
    if args.poison_at_step:
        callbacks.insert(0, Poison())
    if args.measure_memory:
        callbacks = [SaveMemory(True), backup, SaveMemory(False), Report()]
    model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False,
              verbose=0, callbacks=callbacks)  # fmt: skip
    emit("done", step=step(model), digest=digest(model), save_peak=SaveMemory.peak)


def memory(field: str) -> int:
    """A `/proc/self/status` memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class Worker:
    def __init__(self, index: int, args: argparse.Namespace, port: int):
        command = [
            sys.executable, __file__, "--worker", str(index),
            "--processes", str(args.processes), "--devices", str(args.devices),
            "--backup-dir", args.backup_dir, "--epochs", str(args.epochs),
            "--save-freq", str(args.save_freq), "--units", str(args.units),
            "--seconds-per-batch", str(args.seconds_per_batch), "--port", str(port),
        ]  # fmt: skip
        command += ["--snapshot", args.snapshot, "--hold-moves", str(args.hold_moves)]
        command += ["--poison-at-step", str(args.poison_at_step)]
        if args.measure_memory:
            command.append("--measure-memory")
        if args.local_dir:
            command += ["--local-dir", args.local_dir,
                        "--local-save-freq", str(args.local_save_freq)]  # fmt: skip
        env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(EXAMPLES_DIR), env.get("PYTHONPATH", "")]
        )
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, True)),
            threading.Thread(target=self._read, args=(self.process.stderr, False)),
        ]
        for reader in self._readers:
            reader.daemon = True
            reader.start()

    def _read(self, stream, events: bool) -> None:
        for line in stream:
            if not events:
                self.stderr.append(line)
            elif line.startswith("EVENT "):
                self.events.append(json.loads(line[len("EVENT ") :]))

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["kind"] == kind), None)

    def finish(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        return code


def launch(args: argparse.Namespace) -> list[Worker]:
    port = free_ports(1)[0]
    return [Worker(i, args, port) for i in range(args.processes)]


def committed(backup_dir: str) -> list[str]:
    """The committed checkpoints' names: on disk, the renamed directories;
    in a bucket (a URL), the prefixes with their manifest."""
    if "://" in backup_dir:
        import fsspec

        fs, root = fsspec.core.url_to_fs(backup_dir.rstrip("/") + "/chief")
        fs.invalidate_cache()
        try:
            paths = fs.find(root)
        except FileNotFoundError:
            return []
        return sorted(
            p[len(root) :].strip("/").split("/")[0]
            for p in paths
            if p.endswith("/manifest.json")
        )
    chief = os.path.join(backup_dir, "chief")
    try:
        return sorted(n for n in os.listdir(chief) if n.startswith("ckpt-"))
    except FileNotFoundError:
        return []


def newest_step(backup_dir: str) -> int | None:
    """The optimizer step of the newest committed checkpoint."""
    names = committed(backup_dir)
    if not names:
        return None
    if "://" in backup_dir:
        import fsspec

        url = f"{backup_dir.rstrip('/')}/chief/{names[-1]}/metadata.json"
        fs, path = fsspec.core.url_to_fs(url)
        return json.loads(fs.cat_file(path))["step"]
    with open(os.path.join(backup_dir, "chief", names[-1], "metadata.json")) as f:
        return json.load(f)["step"]


def shares(backup_dir: str) -> list[int] | None:
    """Bytes each process wrote into the newest checkpoint (sharded saves)."""
    names = committed(backup_dir)
    if not names:
        return None
    if "://" in backup_dir:
        import fsspec

        url = f"{backup_dir.rstrip('/')}/chief/{names[-1]}/shards.json"
        fs, path = fsspec.core.url_to_fs(url)
        if not fs.exists(path):
            return None  # Whole arrays: written by one process.
        table = json.loads(fs.cat_file(path))
    else:
        path = os.path.join(backup_dir, "chief", names[-1], "shards.json")
        if not os.path.exists(path):
            return None  # Whole arrays: written by one process.
        with open(path) as f:
            table = json.load(f)
    sizes: dict[str, int] = {}
    for variable in table["variables"]:
        for piece in variable["pieces"]:
            sizes[piece["file"]] = sizes.get(piece["file"], 0) + piece["nbytes"]
    return [sizes.get(f"shards-{i:05d}.bin", 0) for i in range(table["processes"])]


def run_launcher(args: argparse.Namespace) -> dict:
    say = (lambda *a: None) if args.quiet else print
    result: dict = {"processes": args.processes, "devices": args.devices}
    say(f"Launching {args.processes} JAX processes x {args.devices} devices, "
        f"backing up to {args.backup_dir}")  # fmt: skip
    workers = launch(args)
    if args.kill_after_commit:
        rng = random.Random(args.seed)
        victim = rng.randrange(args.processes)
        before = set(committed(args.backup_dir))
        deadline = time.monotonic() + args.timeout
        while not set(committed(args.backup_dir)) - before:
            if time.monotonic() > deadline or any(
                w.process.poll() is not None for w in workers
            ):
                for w in workers:
                    w.finish(0)
                raise RuntimeError(
                    "no backup was committed:\n" + "".join(workers[0].stderr[-30:])
                )
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, args.kill_window))
        workers[victim].process.kill()
        seen = max((e["step"] for e in workers[victim].events), default=0)
        codes = {i: w.finish(args.survivor_timeout) for i, w in enumerate(workers)}
        say(f"SIGKILLed process {victim} after step {seen}; relaunching.")
        if args.wipe_local_of is not None:  # That host came back empty.
            shutil.rmtree(os.path.join(args.local_dir, f"process-{args.wipe_local_of}"))
        result.update(bucket_step=newest_step(args.backup_dir))
        result.update(
            victim=victim, killed_after_step=seen, exit_codes_after_kill=codes
        )
        before = committed(args.backup_dir)  # What a restore could read.
        if args.count_bucket_reads:
            s3_server_recording("reset-recording")
            s3_server_recording("start-recording")
        workers = launch(args)
    codes = [w.finish(args.timeout) for w in workers]
    if args.count_bucket_reads and args.kill_after_commit:
        s3_server_recording("stop-recording")
        reads = checkpoint_reads(s3_server_recording("download-recording"), before)
        result.update(bucket_reads_after_relaunch=reads)
    for i, (w, code) in enumerate(zip(workers, codes, strict=True)):
        if code != 0:
            say(f"process {i} exited with {code}:\n" + "".join(w.stderr[-40:]))
    resumed = [w.event("resumed") for w in workers]
    done = [w.event("done") for w in workers]
    result.update(
        exit_codes=codes,
        resumed_steps=[r and r["step"] for r in resumed],
        restored_digests=[r and r["digest"] for r in resumed],
        final_steps=[d and d["step"] for d in done],
        final_digests=[d and d["digest"] for d in done],
        # Each process's first warning of a save refused for a state not
        # finite.
        first_non_finite=[
            next((x.strip() for x in w.stderr if "diverged model" in x), None)
            for w in workers
        ],
        save_peaks=[d and d["save_peak"] for d in done],
        committed=committed(args.backup_dir),
        shares=shares(args.backup_dir),
    )
    say(f"Started at step {result['resumed_steps'][0]}, finished at step "
        f"{result['final_steps'][0]}.")  # fmt: skip
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1,
                        help="CPU devices per process")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-freq", type=int, default=0,
                        help="save every N batches (0: every epoch)")  # fmt: skip
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--seconds-per-batch", type=float, default=0.0)
    parser.add_argument("--kill-after-commit", action="store_true")
    parser.add_argument("--measure-memory", action="store_true",
                        help="report each process's host memory per save")  # fmt: skip
    parser.add_argument("--kill-window", type=float, default=0.5)
    parser.add_argument("--survivor-timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--backup-dir")
    parser.add_argument(
        "--local-dir", help="a local tier: process i's is <local-dir>/process-i"
    )
    add_snapshot_argument(parser)
    parser.add_argument(
        "--hold-moves",
        type=float,
        default=0.0,
        help="hold each save's move to host memory back this many seconds, "
        "while training goes on (with --snapshot device)",
    )
    parser.add_argument(
        "--poison-at-step",
        type=int,
        default=0,
        help="write NaN into the part of a kernel only the last process "
        "holds, at this step's end",
    )
    parser.add_argument("--local-save-freq", type=int, default=1)
    parser.add_argument(
        "--wipe-local-of",
        type=int,
        help="empty this process's local tier before relaunching",
    )
    parser.add_argument(
        "--count-bucket-reads",
        action="store_true",
        help="with a local moto S3 server: count the checkpoint objects the "
        "relaunch after --kill-after-commit reads",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--worker", type=int, dest="index")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.index is not None:
        run_worker(args)
        return
    if args.backup_dir is None:
        args.backup_dir = tempfile.mkdtemp(prefix="keras-ft-model-parallel-")
    run_launcher(args)


if __name__ == "__main__":
    main()
