"""Where a save's CPU time goes: each thread's CPU time (user and system, from
`/proc/self/task`) during a `fit()` saving every batch, against the same fit
without a callback, per step, in one process, fits interleaved.

A save every batch on 2 cores is bound by CPU: the step's own threads (XLA's
or TensorFlow's pools, the training thread) and keras-ft's (the training
thread's share of the copy, the copy helper, the check, the checksum, the
writer, the fsyncs) share the cores. The table says what each costs, so that
a change to the save path can be judged by the CPU it takes away, not only by
a wall time that moves with everything else on the machine. Native threads
are named by their kernel name (`native:...`), keras-ft's by their Python name.

Run: `python benchmarks/cpu_per_thread.py --backend jax` (Linux only).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from save_cost import build_model, data  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_by_thread() -> collections.Counter:
    """Seconds of user and system CPU time of each thread alive now, summed
    by name (`"<name> sys"` for the system part alone)."""
    names = {t.native_id: t.name.rstrip("0123456789_") for t in threading.enumerate()}
    seconds: collections.Counter = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # Ended since listed.
            continue
        kernel_name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        user, system = int(fields[11]) / _TICK, int(fields[12]) / _TICK
        name = names.get(int(tid), "native:" + kernel_name.rstrip("0123456789-_"))
        seconds[name] += user + system
        seconds[name + " sys"] += system
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200, help="saves a fit")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    import keras

    import keras_ft

    class Probe(keras.callbacks.Callback):
        """First in the list: reads the threads before keras-ft's train
        begin, and at train end before keras-ft closes its pools."""

        def on_train_begin(self, logs=None):
            self.begin = cpu_by_thread()

        def on_train_end(self, logs=None):
            self.end = cpu_by_thread()

        def get_state(self):  # Nothing to carry over a resume.
            return {}

        def set_state(self, state):
            pass

    model = build_model(args.width)
    x, y = data(args.steps)
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)  # Compiled.
    root = tempfile.mkdtemp()
    per_step: dict[str, dict[str, list[float]]] = {"none": {}, "keras-ft": {}}
    wall: dict[str, list[float]] = {"none": [], "keras-ft": []}
    for round_ in range(args.rounds):
        arms = ("none", "keras-ft") if round_ % 2 == 0 else ("keras-ft", "none")
        for arm in arms:
            probe = Probe()
            callbacks = [probe]
            if arm == "keras-ft":
                backup = os.path.join(root, f"b{round_}")
                callbacks.append(keras_ft.BackupAndRestore(backup, save_freq=1))
            start = time.perf_counter()
            model.fit(x, y, batch_size=32, verbose=0, callbacks=callbacks)
            wall[arm].append((time.perf_counter() - start) / args.steps * 1e3)
            keras_ft.wait_for_backups()
            for name, seconds in probe.end.items():
                used = (seconds - probe.begin.get(name, 0.0)) / args.steps * 1e3
                per_step[arm].setdefault(name, []).append(used)
    shutil.rmtree(root, ignore_errors=True)

    def median(arm: str, name: str) -> float:
        return statistics.median(per_step[arm].get(name, [0.0]))

    names = sorted(
        {n for arm in per_step for n in per_step[arm] if not n.endswith(" sys")},
        key=lambda n: -median("keras-ft", n),
    )
    backend = keras.backend.backend()
    print(f"\n{backend}: CPU ms per step (user+system, system), medians of "
          f"{args.rounds} fits of {args.steps} steps, a save every step "
          f"(checkpoint {model.count_params() * 12 / 1e6:.0f} MB)")  # fmt: skip
    print(f"{'thread':32} | {'no callback':>14} | {'keras-ft':>14}")
    total = {"none": 0.0, "keras-ft": 0.0}
    for name in names:
        cells = []
        for arm in ("none", "keras-ft"):
            used, system = median(arm, name), median(arm, name + " sys")
            total[arm] += used
            cells.append(f"{used:6.1f} ({system:4.1f})")
        if max(median("none", name), median("keras-ft", name)) >= 0.1:
            print(f"{name:32} | {cells[0]:>14} | {cells[1]:>14}")
    print(f"{'all threads':32} | {total['none']:14.1f} | {total['keras-ft']:14.1f}")
    print(f"{'wall time a step':32} | {statistics.median(wall['none']):14.1f} | "
          f"{statistics.median(wall['keras-ft']):14.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
