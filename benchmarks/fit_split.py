"""Where the time a backed-up `fit()` adds goes, on the device the backend finds.

One process per backend, rounds interleaved (no callback, keras-ft with
`snapshot="auto"`, keras-ft with `snapshot="host"`), a new callback for each
fit() as a script makes one, saving every epoch. Each fit() is split by a
clock callback at the end of the list into:

- train begin: from the `fit()` call to its first batch's begin (the restore
  attempt, the layout walk, the copy buffer's set-up);
- steps: each epoch's first batch's begin to its last batch's end (slowed
  steps: a move or a write competing with training);
- epoch ends: each epoch's last batch's end to the end of the epoch's
  callbacks (the save's share of the training thread);
- between: each epoch's end to the next one's first batch (the data
  iterator, every callback's epoch begin);
- train end: the last epoch's end to `fit()`'s return (waiting for the last
  write's commit, deleting the backup).

The added time of a mode is its median minus the no-callback median, part by
part. Beside it, in the same process: each save's timeline (snapshot on the
training thread, move or copy into host memory, the NaN check, the write,
the commit), with the thread CPU seconds of each stage; the copy buffer's
allocation and page-locking (how long, and on which thread); peak device and
host memory above training's, per mode.

Every measurement is printed as a `JSON` line as soon as it is taken, so that
a run cut short by its time limit keeps what it had; `--from-log FILE`
prints the table of such a log.

Run: `python benchmarks/fit_split.py --backend jax` (a GPU: the defaults,
the ~203M-parameter MLP, 3 epochs of at least 10 s); `--quick` on a CPU.
Target (docs/benchmarks.md): `fit()` with / without <= 1.02 on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from save_cost import build_model, data, peak_while, rss_bytes  # noqa: E402

MODES = ("none", "auto", "host")
PARTS = ("total", "train_begin", "steps", "epoch_ends", "between", "train_end")


# What this run measured so far, for the table at its end.
_measured: list[dict] = []


def say(kind: str, **fields) -> None:
    """One measurement, printed as soon as it is taken."""
    _measured.append({"kind": kind, **fields})
    print("JSON " + json.dumps(_measured[-1]), flush=True)


class Stages:
    """Each save stage's calls, timed where they run: wraps keras-ft's own
    functions in this process only (the package is not changed)."""

    def __init__(self):
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._originals: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, stage: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            cpu, start = time.thread_time(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record = {
                    "stage": stage,
                    "thread": threading.current_thread().name,
                    "start": start,
                    "seconds": time.perf_counter() - start,
                    "cpu": time.thread_time() - cpu,
                }
                with self._lock:
                    self.records.append(record)

        self._originals.append((owner, name, original))
        setattr(owner, name, timed)

    def install(self) -> None:
        from keras_ft.checkpoint.local import LocalStorage
        from keras_ft.saves import save
        from keras_ft.state.training_state import TrainingState
        from keras_ft.state.weights_copy import CapturedWeights, CopyBuffer

        self.wrap(TrainingState, "snapshot", "snapshot")
        self.wrap(CapturedWeights, "fill", "move")
        self.wrap(CopyBuffer, "_check", "check")
        self.wrap(save, "write_snapshot", "write")
        self.wrap(LocalStorage, "commit", "commit")
        self.wrap(CopyBuffer, "_allocate", "allocate")
        self.wrap(CopyBuffer, "_lock", "page-lock")

    def take(self) -> list[dict]:
        with self._lock:
            records, self.records = self.records, []
        return records


def Clock():  # noqa: N802  A class made when Keras is imported.
    import keras

    class Clock(keras.callbacks.Callback):
        """Timestamps of the fit() it is last in the list of."""

        def __init__(self):
            super().__init__()
            self.first: dict[int, float] = {}
            self.last: dict[int, float] = {}
            self.ended: dict[int, float] = {}
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.first.setdefault(self.epoch, time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            self.last[self.epoch] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.ended[epoch] = time.perf_counter()

        def get_state(self) -> dict:
            return {}  # Timestamps of this process: nothing to resume.

        def set_state(self, state: dict) -> None:
            pass

        def split(self, called: float, returned: float) -> dict:
            epochs = sorted(self.ended)
            parts = {
                "total": returned - called,
                "train_begin": self.first[0] - called,
                "steps": sum(self.last[e] - self.first[e] for e in epochs),
                "epoch_ends": sum(self.ended[e] - self.last[e] for e in epochs),
                "each_epoch_end": [self.ended[e] - self.last[e] for e in epochs],
                "train_end": returned - self.ended[epochs[-1]],
            }
            # From an epoch's end to the next one's first batch (the data
            # iterator's set-up, every callback's epoch begin).
            parts["between"] = sum(
                self.first[e] - self.ended[e - 1] for e in epochs[1:]
            )
            return parts

    return Clock()


def device_bytes() -> int:
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.memory_allocated()
    return 0


def one_fit(model, x, y, mode: str, epochs: int, root: str) -> dict:
    """One fit() of `mode`, split; with its peaks of memory."""
    import keras_ft

    clock = Clock()
    callbacks = [clock]
    if mode != "none":
        backup = keras_ft.BackupAndRestore(
            os.path.join(root, f"backup-{mode}"), snapshot=mode, verbose=0
        )
        callbacks.insert(0, backup)
    times = {}
    device_before, host_before = device_bytes(), rss_bytes()

    def fit() -> None:
        called = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        times.update(clock.split(called, time.perf_counter()))

    host_peak = [0]

    def both() -> None:
        host_peak[0] = peak_while(fit, rss_bytes) - host_before

    device_peak = peak_while(both, device_bytes) - device_before
    times["device_peak"] = device_peak
    times["host_peak"] = host_peak[0]
    return times


def measure(args) -> None:
    import keras

    keras.utils.set_random_seed(0)
    model = build_model(args.width)
    x, y = data(args.steps)
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # Compiled.
    state_bytes = sum(
        math.prod(v.shape) * 4 for v in model.weights + model.optimizer.variables
    )  # float32 throughout.
    # Steps for an epoch of at least --epoch-seconds.
    start = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    step = (time.perf_counter() - start) / args.steps
    steps = max(args.steps, int(args.epoch_seconds / max(step, 1e-6)) + 1)
    if steps > args.steps:
        x, y = data(steps)
    say("setup", backend=keras.backend.backend(), width=args.width,
        parameters=model.count_params(), state_bytes=state_bytes,
        step_seconds=step, steps=steps, epochs=args.epochs,
        devices=str(_devices()))  # fmt: skip
    stages = Stages()
    stages.install()
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        # keras-ft's first fit() in a process compiles its own functions:
        # not a cost of the fits measured.
        one_fit(model, x[:64], y[:64], "auto", 1, root)
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else MODES[::-1]
            for mode in order:
                stages.take()
                split = one_fit(model, x, y, mode, args.epochs, root)
                say("fit", mode=mode, round=round_, **split)
                for record in stages.take():
                    say("stage", mode=mode, round=round_, **record)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _devices() -> list:
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.devices()
    if keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(0)]
    return ["cpu"]


def table(lines: list[dict]) -> str:
    """The split, added time per part, and each save's timeline, from the
    JSON lines of a run (whole or cut short)."""
    out = []
    setup = next((line for line in lines if line["kind"] == "setup"), None)
    if setup is not None:
        out.append(
            f"{setup['backend']} on {setup['devices']}: {setup['parameters']:,} "
            f"parameters, state {setup['state_bytes'] / 1e6:.0f} MB, "
            f"{setup['epochs']} epochs of {setup['steps']} steps "
            f"({setup['step_seconds'] * 1e3:.1f} ms a step)"
        )
    fits = collections.defaultdict(list)
    for line in lines:
        if line["kind"] == "fit":
            fits[line["mode"]].append(line)
    if not fits:
        return "\n".join(out + ["(no fit() measured)"])
    medians = {
        mode: {p: statistics.median(f[p] for f in runs) for p in PARTS}
        for mode, runs in fits.items()
    }
    out.append("")
    out.append("| mode | rounds | " + " | ".join(PARTS) + " | fit() / none |")
    out.append("|---|---|" + "---|" * len(PARTS) + "---|")
    base = medians.get("none")
    for mode in MODES:
        if mode not in medians:
            continue
        cells = []
        for part in PARTS:
            value = medians[mode][part]
            added = "" if base is None or mode == "none" else (
                f" (+{value - base[part]:.3f})"
            )  # fmt: skip
            cells.append(f"{value:.3f}{added}")
        ratio = "" if base is None else f"{medians[mode]['total'] / base['total']:.3f}"
        out.append(f"| {mode} | {len(fits[mode])} | " + " | ".join(cells)
                   + f" | {ratio} |")  # fmt: skip
    out.append("")
    out.append("Seconds (median); in brackets, added to no callback's.")
    for mode in MODES:
        if mode in fits:
            peaks = fits[mode]
            out.append(
                f"{mode}: each epoch end (s) "
                + ", ".join(f"{s:.3f}" for s in peaks[-1]["each_epoch_end"])
                + f"; peak device +{max(f['device_peak'] for f in peaks) / 1e6:.0f}"
                f" MB, host +{max(f['host_peak'] for f in peaks) / 1e6:.0f} MB"
            )
    stages = collections.defaultdict(list)
    for line in lines:
        if line["kind"] == "stage":
            stages[(line["mode"], line["stage"])].append(line)
    if stages:
        out.append("")
        out.append(
            "| mode | stage | calls | median s | max s | CPU s (sum) | threads |"
        )
        out.append("|---|---|---|---|---|---|---|")
        for (mode, stage), records in sorted(stages.items()):
            seconds = [r["seconds"] for r in records]
            threads_ = sorted({r["thread"].rstrip("_0123456789") for r in records})
            out.append(
                f"| {mode} | {stage} | {len(records)} | "
                f"{statistics.median(seconds):.4f} | {max(seconds):.4f} | "
                f"{sum(r['cpu'] for r in records):.3f} | {', '.join(threads_)} |"
            )
    return "\n".join(out)


def read_log(path: str) -> list[dict]:
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("JSON "):
                with contextlib.suppress(json.JSONDecodeError):  # Cut short.
                    lines.append(json.loads(line[5:]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"))
    parser.add_argument("--width", type=int, default=14000, help="~203M parameters")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epoch-seconds", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=50, help="at least")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", help="where checkpoints go (default: /tmp)")
    parser.add_argument("--quick", action="store_true", help="CPU-sized")
    parser.add_argument("--from-log", help="print the table of a run's log")
    args = parser.parse_args()
    if args.from_log:
        print(table(read_log(args.from_log)))
        return
    if args.quick:
        args.width, args.epoch_seconds, args.steps = 512, 1.0, 20
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    measure(args)
    print(table(_measured))


if __name__ == "__main__":
    main()
