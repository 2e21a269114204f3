"""Sharded saves across JAX processes: keras-ft vs Orbax's `CheckpointManager`.

N JAX processes on 127.0.0.1 (one CPU device each) train one MLP under
`keras.distribution.ModelParallel`, every kernel split across all processes'
devices, and save every few batches with:

- no callback;
- `keras_ft.BackupAndRestore` (asynchronous; each process writes its pieces,
  the chief commits);
- Orbax's own `CheckpointManager` with the same sharding, asynchronous
  (`enable_async_checkpointing=True`), saving the model's and optimizer's
  arrays as they are (`StandardSave`), from a callback.

For N = 1, 2 and 4 it reports the fit time each adds per save, the bytes each
process writes, keras-ft's chief commit time (from the moment every process's
part is on disk to the rename: the part of a save that does not shrink as
processes are added), and the time to restore the last save into the running
processes, checksums verified (keras-ft, `WorkerTrainingState.restore()`)
against `CheckpointManager.restore()` into the same shardings, from disk (the
page cache is emptied first where the benchmark runs as root).

With `--bucket`, the same runs back up to a local S3 server (moto, on
127.0.0.1) instead: keras-ft into the bucket alone (each process uploads its
pieces, the chief commits the manifest), and with a local tier (`local_dir`: every
save committed on local disk first, then uploaded). It reports the fit time each
adds per save and the restore: from the bucket (ranged GETs of each process's
pieces), from the local tier, and the time to read a process's share of the tier
from disk (the floor of a local restore). Orbax is not run against the bucket.

Needs `orbax-checkpoint` (installed by `make bench` for this script only).
Run: `python benchmarks/sharded.py [--processes 1 2 4] [--units 2048] [--bucket]`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESTORES = 5  # Restores timed per run; the median is reported.
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from local_cluster import free_ports  # noqa: E402
from scaling import drop_page_cache  # noqa: E402

FEATURES, BATCH = 256, 32


def worker(args: argparse.Namespace) -> None:
    import jax

    count = args.processes[0]  # A worker is told one process count.
    if count > 1:
        import keras_ft

        # jax.distributed with a 10 s heartbeat (JAX's
        # default keeps the survivors of a dead process waiting 100 s).
        keras_ft.initialize_cluster(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=count,
            process_id=args.index,
        )
    import keras
    import numpy as np

    import keras_ft
    from keras_ft.distribute import sharded

    devices = jax.devices()
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices=devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden.*kernel"] = (None, "model")
    layout_map[".*hidden.*bias"] = ("model",)
    layout_map[".*output.*kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False
        )
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(args.units, name="hidden_1"),
            keras.layers.Dense(args.units, name="hidden_2"),
            keras.layers.Dense(FEATURES, name="output"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-5), "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * args.batches, FEATURES)).astype("float32")
    model.fit(x[:BATCH], x[:BATCH], batch_size=BATCH, verbose=0)  # Compile.
    directory = os.path.join(args.dir, args.callback)
    commits: list[float] = []
    blocked: list[float] = []
    callbacks: list = []
    manager = None

    def state_of(m: keras.Model) -> list:
        return [v.value for v in m.weights + m.optimizer.variables]

    bucket = os.environ.get("BENCH_BUCKET_URL")
    tier = os.path.join(args.dir, "tier", f"process-{args.index}")
    if args.callback in ("bucket", "tier"):
        local = {"local_dir": tier} if args.callback == "tier" else {}
        callbacks = [
            keras_ft.BackupAndRestore(
                bucket, save_freq=args.every, delete_checkpoint=False, verbose=0,
                **local,
            )
        ]  # fmt: skip
    elif args.callback == "keras-ft":
        # The chief's commit: from "every part is on disk" (one process: its
        # weights file written) to the rename.
        from keras_ft.saves import save as saves_save

        ready: list[float] = []

        def timed(function):
            def wrapper(*a, **k):
                result = function(*a, **k)
                ready.append(time.perf_counter())
                return result

            return wrapper

        sharded.wait_for_parts = timed(sharded.wait_for_parts)
        # The part of each save the training thread waits for.
        back_up = keras_ft.WorkerTrainingState.back_up

        def blocking(self, *a, **k):
            started = time.perf_counter()
            try:
                return back_up(self, *a, **k)
            finally:
                blocked.append(time.perf_counter() - started)

        keras_ft.WorkerTrainingState.back_up = blocking
        saves_save.write_snapshot = timed(saves_save.write_snapshot)

        class Commits(keras_ft.CheckpointListener):
            def after_commit(self, path, epoch, step):
                commits.append(time.perf_counter() - ready[-1])

        callbacks = [
            keras_ft.BackupAndRestore(
                directory, save_freq=args.every, delete_checkpoint=False,
                listeners=[Commits()], verbose=0,
            )
        ]  # fmt: skip
    elif args.callback in ("orbax", "orbax-bucket"):
        import orbax.checkpoint as ocp

        options = {}
        if args.callback == "orbax-bucket":
            directory = bucket
            options["temporary_path_class"] = orbax_on_s3(
                os.environ["AWS_ENDPOINT_URL"]
            )
        manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2, enable_async_checkpointing=True, **options
            ),
        )

        class OrbaxSaves(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if (batch + 1) % args.every == 0:
                    iterations = self.model.optimizer.iterations
                    step = int(keras.ops.convert_to_numpy(iterations))
                    saved = ocp.args.StandardSave(state_of(self.model))
                    manager.save(step, args=saved)

            def on_train_end(self, logs=None):
                manager.wait_until_finished()

        callbacks = [OrbaxSaves()]
    start = time.perf_counter()
    model.fit(x, x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip
    if args.callback in ("keras-ft", "bucket", "tier"):
        keras_ft.wait_for_backups()
    fit = time.perf_counter() - start
    # Restores read from disk (if the page cache can be emptied: root), after
    # the chief's last commit, every process at once; the median of
    # RESTORES (one read from disk varies by 2-3x on these VMs). With a local
    # tier, each round first reads the tier's files alone (the floor), so
    # that a restore and its floor meet the disk in the same state.
    restores, reads = [], []
    # The last save holds the state training ended with; each restore must
    # bring it back into variables set to zero first.
    saved = [np.array(value.addressable_shards[0].data) for value in state_of(model)]
    for _ in range(RESTORES if args.callback != "none" else 0):
        # First: a restore's values may alias the file they were read from
        # (mapped), and pages mapped stay cached when the cache is emptied.
        for variable in model.weights + model.optimizer.variables:
            variable.assign(keras.ops.zeros_like(variable.value))
        gc.collect()
        if args.callback == "tier":
            reads.append(read_from_disk(tier, args.index == 0, count))
        if args.index == 0:
            drop_page_cache()
        if count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("before a restore")
        if args.callback in ("keras-ft", "bucket", "tier"):
            if args.callback == "keras-ft":
                state = keras_ft.WorkerTrainingState(model, directory)
            else:
                local = {"local_dir": tier} if args.callback == "tier" else {}
                state = keras_ft.WorkerTrainingState(model, bucket, **local)
            start = time.perf_counter()
            point = state.restore()
            jax.block_until_ready(state_of(model))
            restores.append(time.perf_counter() - start)
            if args.callback == "tier":  # Read from the tier, not the bucket.
                assert point is not None and not point.checkpoint.startswith("s3://"), (
                    point
                )
            del state, point  # Nothing left holding the file mapped.
        elif manager is not None:
            import orbax.checkpoint as ocp

            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_of(model))
            start = time.perf_counter()
            values = manager.restore(
                manager.latest_step(), args=ocp.args.StandardRestore(abstract)
            )
            for variable, value in zip(
                model.weights + model.optimizer.variables, values, strict=True
            ):
                variable.assign(value)
            jax.block_until_ready(state_of(model))
            restores.append(time.perf_counter() - start)
        if args.callback != "none":
            assert restored(state_of(model), saved), args.callback
    if manager is not None:
        manager.close()
    restore = statistics.median(restores) if restores else None
    params = sum(int(np.prod(v.shape)) for v in model.weights)
    result = {"fit": fit, "restore": restore, "params": params, "commits": commits,
              "blocked": blocked, "restores": restores, "reads": reads}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)


def restored(values: list, saved: list) -> bool:
    """Whether each value's first local shard equals the saved one. (A
    function: no loop variable outlives it holding a value, which may alias
    a mapped checkpoint file that the next round's cold read must find
    evictable.)"""
    import numpy as np

    return all(
        np.array_equal(np.asarray(value.addressable_shards[0].data), expected)
        for value, expected in zip(values, saved, strict=True)
    )


def orbax_on_s3(endpoint: str) -> type:
    """Lets Orbax's `CheckpointManager` save to and restore from `s3://`.

    Orbax 0.12 builds the TensorStore spec of a checkpoint for `gs://` and
    local paths only (an open pull request, google/orbax#2739, would add
    S3). This gives `s3://` paths a spec of TensorStore's own S3 driver,
    pointed at `endpoint`, and returns Orbax's commit-file atomicity (a
    `commit_success.txt` written last, as Orbax commits on GCS: an object
    store has no rename) for `CheckpointManagerOptions(temporary_path_class=)`.
    Directories go through `etils.epath` with fsspec (`EPATH_USE_TF=false`).
    """
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    gcs_kvstore = ts_utils.gcs_utils.get_kvstore_for_gcs
    normalize = ts_utils._normalize_path

    def kvstore(path: str) -> dict:
        if not path.startswith("s3://"):
            return gcs_kvstore(path)
        bucket, _, key = path[len("s3://") :].partition("/")
        return {"driver": "s3", "bucket": bucket, "path": key,
                "endpoint": endpoint, "aws_region": "us-east-1"}  # fmt: skip

    ts_utils.gcs_utils.get_kvstore_for_gcs = kvstore
    ts_utils._use_gcs_driver = lambda path: path.startswith(("gs://", "s3://"))
    ts_utils._normalize_path = lambda path: (
        normalize(path).replace("s3:/", "s3://", 1)
        if path.startswith("s3://")
        else normalize(path)
    )
    return atomicity.CommitFileTemporaryPath


def read_from_disk(tier: str, drops_cache: bool, count: int) -> float:
    """Seconds to read the files of the newest checkpoint in `tier` from
    disk (the page cache emptied first, where it can be), every process at
    once: the floor of a restore from the local tier."""
    (backup,) = os.listdir(tier)  # keras-ft's directory for this backup.
    tier = os.path.join(tier, backup)
    newest = max(n for n in os.listdir(tier) if n.startswith("ckpt-"))
    path = os.path.join(tier, newest)
    if drops_cache:
        drop_page_cache()
    if count > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("before a read")
    start = time.perf_counter()
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    return time.perf_counter() - start


def launch(args: argparse.Namespace, processes: int, callback: str, root: str):
    port = free_ports(1)[0]
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               EPATH_USE_TF="false")  # fmt: skip
    env["PYTHONPATH"] = os.path.dirname(HERE)
    command = [
        sys.executable, os.path.abspath(__file__), "--worker", "0",
        "--processes", str(processes),
        "--callback", callback, "--dir", root, "--port", str(port),
        "--units", str(args.units), "--batches", str(args.batches),
        "--every", str(args.every),
    ]  # fmt: skip
    procs = []
    # In a directory of the run's own: a bucket path that a library takes for
    # a local one (`s3://b` made `s3:/b`) lands there, and is caught below.
    cwd = os.path.join(root, "cwd")
    os.makedirs(cwd, exist_ok=True)
    for i in range(processes):
        command[command.index("--worker") + 1] = str(i)
        procs.append(
            subprocess.Popen(list(command), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
        )  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{callback} x{processes} failed:\n{err[-3000:]}")
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    stray = os.listdir(cwd)
    if stray:
        raise RuntimeError(
            f"{callback} x{processes} wrote {stray} into its working directory: "
            "a bucket path was taken for a local one (its '//' collapsed)."
        )
    return results


def shares(root: str) -> list[int]:
    chief = os.path.join(root, "keras-ft", "chief")
    newest = sorted(n for n in os.listdir(chief) if n.startswith("ckpt-"))[-1]
    path = os.path.join(chief, newest)
    names = sorted(n for n in os.listdir(path) if n.startswith("shards-"))
    if not names:  # One process: whole arrays, one weights file.
        return [os.path.getsize(os.path.join(path, "model.weights.h5"))]
    return [os.path.getsize(os.path.join(path, n)) for n in names]


def commit(staging, parts, count: int, tag: str, specs: list) -> None:
    from keras_ft.distribute import sharded

    sharded.commit_parts(staging, parts, count, tag, specs, ["rows"])


def commit_times(total_mb: int, counts: list[int], rounds: int = 5) -> list[tuple]:
    """The chief's commit alone, without training around it: N parts of
    `total_mb` together are written first (as N processes would), then the
    time from "all parts are there" to the committed rename is taken."""
    import numpy as np

    from keras_ft.checkpoint.store import CheckpointStore
    from keras_ft.distribute import sharded

    rows = []
    for count in counts:
        root = tempfile.mkdtemp(prefix="keras-ft-commit-bench-")
        store = CheckpointStore(os.path.join(root, "chief"))
        columns = 1024
        rows_per_part = total_mb * 2**20 // 4 // columns // count
        specs = [["model", "kernel", [rows_per_part * count, columns], "float32"]]
        times = []
        for r in range(rounds):
            tag = f"{r:08d}"
            parts = store.storage.parts(tag, 0)
            for process in range(count):
                block = np.full((rows_per_part, columns), process, np.float32)
                start = (process * rows_per_part, 0)
                stop = ((process + 1) * rows_per_part, columns)
                share = sharded.Share.copy_of([(0, start, stop, block)])
                sharded.write_part(parts, process, tag, share)
            started = time.perf_counter()
            write = functools.partial(
                commit, parts=parts, count=count, tag=tag, specs=specs
            )
            store.save(write, {"step": r})
            times.append(time.perf_counter() - started)
        shutil.rmtree(root, ignore_errors=True)
        rows.append((count, statistics.median(times)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--units", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--commit-mb", type=int, default=227)
    parser.add_argument(
        "--bucket",
        action="store_true",
        help="back up to a local S3 server instead (see above)",
    )
    parser.add_argument("--worker", type=int, dest="index")
    parser.add_argument("--callback", default="none")
    parser.add_argument("--dir")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.index is not None:
        worker(args)
        return
    saves = args.batches // args.every
    if args.bucket:
        bucket_rows(args, saves)
        return
    rows = []
    for processes in args.processes:
        root = tempfile.mkdtemp(prefix="keras-ft-sharded-bench-")
        try:
            base = max(r["fit"] for r in launch(args, processes, "none", root))
            ft = launch(args, processes, "keras-ft", root)
            orbax = launch(args, processes, "orbax", root)
            per_process = shares(root)
            params = ft[0]["params"]
            commits = ft[0]["commits"]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        added_ft = (max(r["fit"] for r in ft) - base) / saves * 1000
        added_orbax = (max(r["fit"] for r in orbax) - base) / saves * 1000
        restore_ft = max(r["restore"] for r in ft)
        restore_orbax = max(r["restore"] for r in orbax)
        commit = statistics.median(commits)
        blocked = max(statistics.median(r["blocked"]) for r in ft)
        rows.append((processes, params, per_process, added_ft, added_orbax,
                     restore_ft, restore_orbax, commit, blocked))  # fmt: skip
    print(f"\n{params / 1e6:.1f}M-parameter MLP + Adam, ModelParallel over N JAX "
          f"processes (1 CPU device each), {args.batches} batches, a save every "
          f"{args.every}.\n")  # fmt: skip
    print("| processes | MB per process | added ms/save keras-ft | Orbax | ratio "
          "| keras-ft in fit thread ms | restore s keras-ft | Orbax | Orbax/keras-ft "
          "| chief commit ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, _, per, a_ft, a_ox, r_ft, r_ox, commit, blocked in rows:
        mb = "/".join(f"{b / 1e6:.0f}" for b in per)
        ratio = a_ft / a_ox if a_ox > 0 else float("nan")
        print(f"| {n} | {mb} | {a_ft:.0f} | {a_ox:.0f} | {ratio:.2f} "
              f"| {blocked * 1000:.0f} | {r_ft:.3f} "
              f"| {r_ox:.3f} | {r_ox / r_ft:.1f}x | {commit * 1000:.1f} |")  # fmt: skip
    print(
        f"\nThe chief's commit alone (no training around it): {args.commit_mb} MB "
        "in N parts already written, to the committed rename; median of 5.\n"
    )
    print("| parts (processes) | commit ms |")
    print("|---|---|")
    for count, seconds in commit_times(args.commit_mb, [1, 2, 4, 8, 16]):
        print(f"| {count} | {seconds * 1000:.1f} |")


def bucket_rows(args: argparse.Namespace, saves: int) -> None:
    """The `--bucket` table: keras-ft into a local S3 server, with and
    without a local tier."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from conftest import start_moto

    server, port = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    import fsspec

    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
    rows = []
    try:
        for processes in args.processes:
            root = tempfile.mkdtemp(prefix="keras-ft-sharded-bench-")
            try:
                base = max(r["fit"] for r in launch(args, processes, "none", root))
                found = {}
                for callback in ("bucket", "tier", "orbax-bucket"):
                    url = f"s3://bench/{callback}-{processes}-{time.time_ns()}"
                    os.environ["BENCH_BUCKET_URL"] = url
                    found[callback] = launch(args, processes, callback, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            added = {
                c: (max(r["fit"] for r in found[c]) - base) / saves * 1000
                for c in found
            }
            # Per round, the slowest process (the others wait for it), then
            # the median over rounds; the ratio paired within each round.
            tier = found["tier"]
            restores = [
                max(r) for r in zip(*(p["restores"] for p in tier), strict=True)
            ]
            reads = [max(r) for r in zip(*(p["reads"] for p in tier), strict=True)]
            ratios = [a / b for a, b in zip(restores, reads, strict=True)]
            rows.append((
                processes, found["bucket"][0]["params"], added["bucket"],
                added["tier"], added["orbax-bucket"],
                max(r["restore"] for r in found["bucket"]),
                max(r["restore"] for r in found["orbax-bucket"]),
                statistics.median(restores), statistics.median(reads),
                statistics.median(ratios), min(ratios), max(ratios),
            ))  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"\n{rows[0][1] / 1e6:.1f}M-parameter MLP + Adam, ModelParallel over N JAX "
          f"processes (1 CPU device each), {args.batches} batches, a save every "
          f"{args.every}, to a local S3 server (moto, same 2 cores).\n")  # fmt: skip
    print("| processes | added ms/save bucket | with local tier | Orbax "
          "| restore s bucket | Orbax | Orbax / keras-ft, target >= 1 "
          "| local tier | read of the tier's files s | tier / read (min-max), "
          "target <= 1.2 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, _, a_b, a_t, a_o, r_b, r_o, r_t, read, ratio, low, high in rows:
        print(f"| {n} | {a_b:.0f} | {a_t:.0f} | {a_o:.0f} | {r_b:.3f} | {r_o:.3f} "
              f"| {r_o / r_b:.2f} | {r_t:.3f} | {read:.3f} "
              f"| {ratio:.2f}x ({low:.2f}-{high:.2f}) |")  # fmt: skip
    print(
        "\nOrbax: its `CheckpointManager` (asynchronous, `StandardSave` of the "
        "same sharded arrays) with the S3 TensorStore spec of google/orbax#2739 "
        "patched in (`orbax_on_s3()`); restores with `StandardRestore` into the "
        "same shardings, as keras-ft restores."
    )


if __name__ == "__main__":
    main()
