"""What a save costs a 2-process cluster on 127.0.0.1: each worker's time held up.

In a cluster every step waits for the slowest process (the gradients'
all-reduce), so a save costs the cluster what it costs the process it holds up
longest. keras-ft's chief copies the state and writes it in the background;
every other worker writes a throwaway save into a directory of its own (see
`keras_ft/saves/throwaway.py`). This script trains one data-parallel MLP with
Adam on two processes (JAX `DataParallel` over `jax.distributed`, or TensorFlow
`MultiWorkerMirroredStrategy`), saving every `--save-freq` batches, and prints,
per process: `fit()` with each callback over `fit()` without one, and the time
each keras-ft save held that process's training thread up
(`BackupAndRestore.backup_seconds`). Keras' own `BackupAndRestore` knows nothing
of workers: each process gets a directory of its own. Rounds alternate the
callbacks in one pair of processes; medians.

Run: `python benchmarks/cluster_saves.py [--backend jax|tensorflow] [--units 1024]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
from local_cluster import free_ports, join_cluster  # noqa: E402

FEATURES, BATCH = 64, 32  # BATCH rows per process and step.


def worker(args: argparse.Namespace) -> None:
    backend = os.environ["KERAS_BACKEND"]
    scope = join_cluster(args.index, 2, args.ports)
    import keras
    import numpy as np

    import keras_ft

    keras.utils.set_random_seed(7)
    with scope:
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(args.units, activation="relu"),
                keras.layers.Dense(args.units, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    rows = 2 * BATCH * args.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    if backend == "tensorflow":
        import tensorflow as tf

        def data(n: int) -> dict:
            dataset = tf.data.Dataset.from_tensor_slices((x[:n], y[:n]))
            return {"x": dataset.batch(2 * BATCH)}
    else:

        def data(n: int) -> dict:
            return {"x": x[:n], "y": y[:n], "batch_size": 2 * BATCH, "shuffle": False}

    # Compiles. A first `fit()` without a callback failed here under
    # MultiWorkerMirroredStrategy (Keras 3.15's symbolic build was handed
    # `PerReplica` data); with keras-ft's callback it does not.
    warm = keras_ft.BackupAndRestore(os.path.join(args.backup_dir, "warm"))
    model.fit(epochs=1, verbose=0, callbacks=[warm], **data(4 * BATCH))
    state_bytes = sum(
        int(np.prod(v.shape)) * 4 for v in model.weights + model.optimizer.variables
    )
    saves = args.steps // args.save_freq
    rows_out: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for name in ("none", "keras", "keras-ft"):
            callbacks = []
            directory = os.path.join(args.backup_dir, f"{name}-{round_}")
            if name == "keras":
                callbacks = [
                    keras.callbacks.BackupAndRestore(
                        f"{directory}-worker-{args.index}", save_freq=args.save_freq
                    )
                ]
            elif name == "keras-ft":
                callbacks = [
                    keras_ft.BackupAndRestore(
                        directory, save_freq=args.save_freq, verbose=0
                    )
                ]
            start = time.perf_counter()
            model.fit(epochs=1, verbose=0, callbacks=callbacks, **data(rows))
            rows_out.setdefault(name, []).append(time.perf_counter() - start)
            if name == "keras-ft":
                held = callbacks[0].backup_seconds / saves
                rows_out.setdefault("held", []).append(held)
    print(
        "RESULT " + json.dumps({"index": args.index, "bytes": state_bytes, **rows_out}),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=os.environ.get("KERAS_BACKEND", "jax"),
                        choices=["jax", "tensorflow"])  # fmt: skip
    parser.add_argument("--units", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-freq", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--index", type=int)
    parser.add_argument("--ports", type=int, nargs="*")
    parser.add_argument("--backup-dir")
    args = parser.parse_args()
    if args.index is not None:
        worker(args)
        return
    backup_dir = tempfile.mkdtemp(prefix="keras-ft-cluster-saves-")
    ports = free_ports(2)
    env = dict(
        os.environ,
        KERAS_BACKEND=args.backend,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    )
    common = [
        "--units", str(args.units), "--steps", str(args.steps),
        "--save-freq", str(args.save_freq), "--rounds", str(args.rounds),
        "--backup-dir", backup_dir, "--ports", *map(str, ports),
    ]  # fmt: skip
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--index", str(i), *common],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=1800)
            line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            if process.returncode or not line:
                sys.exit(f"worker failed ({process.returncode}):\n{stderr[-3000:]}")
            results.append(json.loads(line[0][len("RESULT ") :]))
    finally:
        for process in processes:
            process.kill()
        shutil.rmtree(backup_dir, ignore_errors=True)
    state_mb = results[0]["bytes"] / 1e6
    saves = args.steps // args.save_freq
    print(
        f"{args.backend}, 2 processes, {state_mb:.0f} MB state, {args.steps} steps, "
        f"a save every {args.save_freq} ({saves} saves), {args.rounds} rounds, medians"
    )
    print("| | chief (process 0) | worker (process 1) |")
    print("|---|---|---|")
    for name in ("keras", "keras-ft"):
        ratios = [
            statistics.median(a / b for a, b in zip(r[name], r["none"], strict=True))
            for r in results
        ]
        cells = " | ".join(f"{x:.3f}" for x in ratios)
        print(f"| fit with {name} / without |  {cells} |")
    added = [
        statistics.median(
            (a - b) / saves for a, b in zip(r["keras-ft"], r["none"], strict=True)
        )
        for r in results
    ]
    held = [statistics.median(r["held"]) for r in results]
    for label, values in (
        ("keras-ft added per save, ms", added),
        ("keras-ft held training up per save, ms", held),
    ):
        print(f"| {label} | " + " | ".join(f"{1e3 * x:.1f}" for x in values) + " |")


if __name__ == "__main__":
    main()
