"""Recovery: from a relaunch after a SIGKILL to training at the batch killed.

A training (one process) is SIGKILLed in its first epoch at 10 %, 50 % and
90 % of the epoch, `--since` batches after its last backup, and relaunched
with the same script. Measured, side by side in one run, per input:

- cold: a fresh start with no callback, to its first batch (what any
  relaunch pays: interpreter, imports, model, first step);
- keras-ft: `keras_ft.BackupAndRestore(save_freq=--save-every)`, from the
  relaunch to the start of the batch killed;
- Keras: `keras.callbacks.BackupAndRestore(save_freq=--save-every)`, the same;
- Orbax: `keras.callbacks.OrbaxCheckpoint(save_freq=--save-every)`, resumed by
  hand as its docs have it (`model.load_weights(directory)` when the
  directory holds a checkpoint, then `fit()`: the epoch starts again at its
  first batch); only where `orbax-checkpoint` is installed (`make bench`
  installs it);
- floor: cold + reading the checkpoint (`WorkerTrainingState.restore()`,
  measured on the backup left by the kill) + training the `--since` batches
  trained after the backup (from the killed run's own batch time).

The overhead of a resume is its time minus the cold start; the target
(the "recovery in seconds" issue) is keras-ft within 0.5 s of the floor at
every kill position.

Then the other half of recovery, the work a kill loses: one uninterrupted
epoch per keras-ft schedule (every `--save-every` batches, `"auto"`,
`"continuous"`), on the `PyDataset` input (its per-item time keeps the host
waiting, as an accelerator's step would), its batch ends and commits timed;
for kills at 1,000 moments spread over the epoch, the batches trained since
the newest commit (lost), beside the epoch's time over no callback (the
schedule's cost).

Inputs: NumPy arrays (`fit(shuffle=True)`), a `keras.utils.PyDataset` whose
`__getitem__` costs `--item-ms` (a decode stand-in), `tf.data` with
`Dataset.shuffle()`, and a Grain `MapDataset` of the same batches, shuffled,
whose source costs `--item-ms` a batch (read by Grain's own threads), where
`grain` is installed.

Usage:
    python benchmarks/recovery.py                   # JAX, every input, 3 kills
    python benchmarks/recovery.py --quick           # fewer batches
    python benchmarks/recovery.py --backend tensorflow --inputs pydataset
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("cold", "keras_ft", "keras", "orbax")
INPUTS = ("arrays", "pydataset", "tfdata", "grain")


def child(args: argparse.Namespace) -> None:
    """One training process: prints `AT <seconds since launch>` when it
    reaches batch `--stop-at` of the first epoch, then leaves; with
    `--kill-at`, SIGKILLs itself there instead (after its backups are in)."""
    import signal

    import keras
    import numpy as np

    import keras_ft

    batch_size, width = 32, args.width
    batches = args.batches
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * batch_size, width)).astype("float32")
    y = x[:, :1] * 2.0 + 1.0

    def load(index: int):
        time.sleep(args.item_ms / 1000)
        part = slice(index * batch_size, (index + 1) * batch_size)
        return x[part], y[part]

    class Decoded(keras.utils.PyDataset):
        def __len__(self) -> int:
            return batches

        def __getitem__(self, index: int):
            return load(index)

    class Source:  # Grain's random-access source of the same batches.
        def __len__(self) -> int:
            return batches

        def __getitem__(self, index: int):
            return load(index)

    if args.input == "arrays":
        data, fit_args = (x, y), {"batch_size": batch_size, "shuffle": True}
    elif args.input == "pydataset":
        data, fit_args = (Decoded(),), {"shuffle": True}
    elif args.input == "grain":
        import grain

        data, fit_args = (grain.MapDataset.source(Source()).shuffle(seed=0),), {}
    else:
        import tensorflow as tf

        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=0)
        data, fit_args = (dataset.batch(batch_size),), {}

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((width,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    started = float(os.environ["RECOVERY_LAUNCHED"])

    class Stop(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 0 and batch == 1:
                self.first = time.perf_counter()
            if self.epoch != 0 or batch != args.stop_at:
                return
            now = time.time() - started
            if args.kill:
                keras_ft.wait_for_backups()  # The last backup is in.
                per_batch = (time.perf_counter() - self.first) / (batch - 1)
                print(f"BATCH {per_batch:.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"AT {now:.4f}", flush=True)
            sys.stdout.flush()
            os._exit(0)

    every = int(args.every) if args.every.isdigit() else args.every
    if args.timeline:
        timeline(args, model, data, fit_args, every)
        return
    callbacks: list = [Stop()]
    if args.tool == "keras_ft":
        callbacks.insert(0, keras_ft.BackupAndRestore(args.dir, save_freq=every))
    elif args.tool == "keras":
        callbacks.insert(0, keras.callbacks.BackupAndRestore(args.dir, save_freq=every))
    model.fit(*data, epochs=2, verbose=0, callbacks=callbacks, **fit_args)


def timeline(args, model, data, fit_args, every) -> None:
    """One epoch (after a warm-up one) with schedule `every` (or none, for
    `--tool cold`); prints its batch ends and commits, in seconds from the
    epoch's start, as `ENDS ...` and `COMMITS step@seconds ...`."""
    import keras

    import keras_ft

    ends, commits = [], []

    class Times(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.epoch = time.perf_counter(), epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1:
                ends.append(time.perf_counter() - self.start)

    times = Times()

    class Commits(keras_ft.CheckpointListener):
        def after_commit(self, path, epoch, step):
            if times.epoch == 1:
                commits.append((step - args.batches, time.perf_counter() - times.start))

    callbacks: list = [times]
    if args.tool == "keras_ft":
        callbacks.insert(0, keras_ft.BackupAndRestore(
            args.dir, save_freq=every, listeners=[Commits()], verbose=0
        ))  # fmt: skip
    model.fit(*data, epochs=2, verbose=0, callbacks=callbacks, **fit_args)
    keras_ft.wait_for_backups()
    print("ENDS", " ".join(f"{t:.5f}" for t in ends))
    print("COMMITS", " ".join(f"{step}@{t:.5f}" for step, t in commits))


def lost_batches(ends: list[float], commits: list[tuple[int, float]]) -> list[int]:
    """Batches a kill would lose, for 1,000 kill moments over the epoch."""
    lost = []
    for i in range(1000):
        moment = ends[-1] * (i + 0.5) / 1000
        done = sum(1 for t in ends if t <= moment)
        saved = max((step for step, t in commits if t <= moment), default=0)
        lost.append(done - saved)
    return lost


def launch(backend: str, *extra: str) -> tuple[float, dict[str, float]]:
    """Runs a child; `(wall seconds, {AT/BATCH: value})`."""
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONUNBUFFERED="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["RECOVERY_LAUNCHED"] = repr(time.time())
    begin = time.perf_counter()
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    wall = time.perf_counter() - begin
    said: dict = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("AT", "BATCH"):
            said[key] = float(value)
        elif key == "ENDS":
            said[key] = [float(t) for t in value.split()]
        elif key == "COMMITS":
            said[key] = [
                (int(step), float(t))
                for step, t in (c.split("@") for c in value.split())
            ]
    if not said:
        raise RuntimeError(f"child {extra} said nothing:\n{result.stderr[-3000:]}")
    return wall, said


def restore_seconds(backend: str, directory: str, width: int) -> float:
    """`WorkerTrainingState.restore()` of the backup the kill left, timed in a
    process of its own (the model built as the child builds it)."""
    code = f"""
import os, time, keras, keras_ft
model = keras.Sequential([keras.Input(({width},)), keras.layers.Dense(256),
                          keras.layers.Dense(256), keras.layers.Dense(1)])
model.compile(keras.optimizers.Adam(1e-3), loss="mse")
model.optimizer.build(model.trainable_variables)
state = keras_ft.WorkerTrainingState(model, {os.path.join(directory, "")!r})
begin = time.perf_counter()
with state.locked():
    state.restore()
print("AT", time.perf_counter() - begin)
"""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("AT ")]
    if not line:
        raise RuntimeError(out.stderr[-3000:])
    return float(line[0].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tool", choices=TOOLS, default="cold")
    parser.add_argument("--input", choices=INPUTS, default="arrays")
    parser.add_argument("--dir", default="")
    parser.add_argument("--stop-at", type=int, default=1)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--every", default="50")
    parser.add_argument("--timeline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="jax")
    parser.add_argument("--inputs", nargs="*", choices=INPUTS, default=None)
    parser.add_argument("--batches", type=int, default=600, help="per epoch")
    parser.add_argument("--item-ms", type=float, default=5.0)
    parser.add_argument("--width", type=int, default=64, help="features per row")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--since", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="median of")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.batches, args.rounds = 200, 1
    if args.inputs is None:
        args.inputs = list(INPUTS)
        try:
            import grain  # noqa: F401
        except ImportError:
            args.inputs.remove("grain")
            print("(grain is not installed: no Grain input)")
    common = ["--batches", str(args.batches), "--item-ms", str(args.item_ms)]
    common += ["--width", str(args.width)]
    print(
        f"Recovery, {args.backend}: {args.batches} batches per epoch, a backup every "
        f"{args.save_every}, killed {args.since} batches after one; seconds from "
        f"the relaunch to the batch killed (median of {args.rounds})."
    )
    tools = ["keras_ft", "keras"]
    try:
        import orbax.checkpoint  # noqa: F401

        tools.append("orbax")
    except ImportError:
        print("(orbax-checkpoint is not installed: no OrbaxCheckpoint column)")
    header = (
        f"{'input':<10} {'kill at':>8} {'cold':>6} {'floor':>6} {'keras-ft':>9} "
        f"{'Keras':>7} {'Orbax':>7} {'keras-ft over floor':>20} "
        f"{'Keras over floor':>17} {'Orbax over floor':>17}"
    )
    print(header)
    print("-" * len(header))
    work = tempfile.mkdtemp(prefix="keras-ft-recovery-")
    try:
        for data in args.inputs:
            for share in (0.1, 0.5, 0.9):
                saved = int(args.batches * share) // args.save_every * args.save_every
                kill = saved + args.since
                run = [*common, "--input", data, "--every", str(args.save_every)]
                times: dict[str, list[float]] = {t: [] for t in (*TOOLS, "floor")}
                for _ in range(args.rounds):
                    _, cold = launch(args.backend, *run, "--tool", "cold")
                    times["cold"].append(cold["AT"])
                    for tool in tools:
                        directory = os.path.join(work, tool)
                        shutil.rmtree(directory, ignore_errors=True)
                        at = ["--tool", tool, "--dir", directory]
                        _, killed = launch(
                            args.backend, *run, *at, "--stop-at", str(kill), "--kill"
                        )
                        if tool == "keras_ft":
                            read = restore_seconds(args.backend, directory, args.width)
                            times["floor"].append(
                                cold["AT"] + read + args.since * killed["BATCH"]
                            )
                        stop = ["--stop-at", str(kill)]
                        _, back = launch(args.backend, *run, *at, *stop)
                        times[tool].append(back["AT"])
                m = {k: statistics.median(v) for k, v in times.items() if v}
                orbax = m.get("orbax", float("nan"))
                print(
                    f"{data:<10} {f'{kill}/{args.batches}':>8} {m['cold']:>6.2f} "
                    f"{m['floor']:>6.2f} {m['keras_ft']:>9.2f} {m['keras']:>7.2f} "
                    f"{orbax:>7.2f} {m['keras_ft'] - m['floor']:>+20.2f} "
                    f"{m['keras'] - m['floor']:>+17.2f} {orbax - m['floor']:>+17.2f}",
                    flush=True,
                )
        print_lost_work(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_lost_work(args: argparse.Namespace, work: str) -> None:
    # The PyDataset's per-item time stands for a step that keeps the host
    # waiting (an accelerator's, a decode's): the cores are free to write.
    run = [
        "--batches", str(args.batches), "--item-ms", str(args.item_ms),
        "--input", "pydataset", "--timeline",
    ]  # fmt: skip
    print(
        f"\nLost work, {args.backend}: one epoch of {args.batches} batches (a "
        f"PyDataset, {args.item_ms:g} ms per item), "
        "batches trained since the newest commit at 1,000 kill moments; the "
        f"epoch's time over no callback (median of {args.rounds})."
    )
    header = (
        f"{'schedule':<12} {'lost: mean':>10} {'median':>7} {'max':>5} "
        f"{'saves':>6} {'epoch s':>8} {'over none':>10}"
    )
    print(header)
    print("-" * len(header))
    bare = statistics.median(
        launch(args.backend, *run, "--tool", "cold")[1]["ENDS"][-1]
        for _ in range(args.rounds)
    )
    for every in (str(args.save_every), "auto", "continuous"):
        rounds = []
        for _ in range(args.rounds):
            directory = os.path.join(work, "lost")
            shutil.rmtree(directory, ignore_errors=True)
            at = ["--tool", "keras_ft", "--dir", directory, "--every", every]
            rounds.append(launch(args.backend, *run, *at)[1])
        seconds = statistics.median(r["ENDS"][-1] for r in rounds)
        lost = [n for r in rounds for n in lost_batches(r["ENDS"], r["COMMITS"])]
        saves = statistics.median(len(r["COMMITS"]) for r in rounds)
        print(
            f"{every:<12} {statistics.mean(lost):>10.1f} "
            f"{statistics.median(lost):>7.0f} {max(lost):>5} {saves:>6.0f} "
            f"{seconds:>8.2f} {seconds / bare - 1:>+10.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
