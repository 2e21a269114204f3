"""What a backup callback costs a fit() between its saves: Keras' dispatch ahead.

Keras turns a step's logs into numbers before it calls a batch end that a
callback overrides (which waits for the step on the device), unless every
callback says it is `async_safe`: then it calls the batch ends on a thread of
its own and goes on dispatching steps. This script times, side by side in one
process per backend, interleaved rounds, medians, a small MLP saving only at
the end of its one epoch:

- no callback;
- "synced": a callback whose batch end does nothing, not async-safe;
- Keras' `BackupAndRestore` (`save_freq="epoch"`; it has a batch end);
- keras-ft's `BackupAndRestore` (`save_freq="epoch"`; async-safe on JAX and
  PyTorch);
- the same with keras-ft's `NanGuard` (its check of the weights at every batch,
  launched at a batch's begin and read at the next; async-safe as well), and
  with a not-async-safe batch end beside it (the guard then checks at each
  batch end, after Keras waited for the step: as before it was async-safe).

On a CPU the gain is small (the step is on the same cores as the loop); on a
GPU the synced rows are where a host that waits for every step shows. Run:
`python benchmarks/batch_ends.py` (all backends) or `--backend jax`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from save_cost import interleaved, med, spread  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
KINDS = ("none", "synced", "keras", "keras-ft")
KINDS += ("keras-ft + guard", "keras-ft + guard, synced")


def callbacks(kind: str, path: str) -> list:
    import keras

    import keras_ft

    if kind == "none":
        return []

    class Synced(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    if kind == "synced":
        return [Synced()]
    if kind == "keras":
        return [keras.callbacks.BackupAndRestore(path)]
    backup = keras_ft.BackupAndRestore(path, verbose=0)
    if kind.startswith("keras-ft + guard"):
        synced = [Synced()] if kind.endswith("synced") else []
        return [backup, keras_ft.NanGuard(verbose=0), *synced]
    return [backup]


def measure(args) -> dict:
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * args.steps, 64)).astype("float32")
    y = rng.integers(0, 10, size=(32 * args.steps,))
    result = {"backend": keras.backend.backend(), "steps": args.steps, "widths": {}}
    root = tempfile.mkdtemp(prefix="batch-ends-")
    try:
        for width in args.widths:
            model = keras.Sequential([
                keras.Input((64,)),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(10),
            ])  # fmt: skip
            model.compile(
                "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
            model.fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0)

            def fit(kind: str, model=model):
                def run() -> None:
                    path = os.path.join(root, kind)
                    shutil.rmtree(path, ignore_errors=True)
                    model.fit(
                        x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
                        callbacks=callbacks(kind, path),
                    )  # fmt: skip

                return run

            times = interleaved({k: fit(k) for k in KINDS}, args.rounds)
            result["widths"][width] = times
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def rows_of(result: dict) -> list[tuple[str, str]]:
    rows = []
    for width, times in result["widths"].items():
        none = times["none"]
        step = med(none) / result["steps"]
        rows.append((f"width {width}: no callback, ms a step", f"{step * 1e3:.3f}"))
        for kind in KINDS[1:]:
            ratios = [a / b for a, b in zip(times[kind], none, strict=True)]
            rows.append((f"width {width}: {kind} / no callback", spread(ratios)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    parser.add_argument("--widths", type=int, nargs="*", default=[128, 256, 512])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    print("| backend | measurement | value |\n|---|---|---|")
    for backend in args.backend or BACKENDS:
        command = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--widths", *map(str, args.widths)]  # fmt: skip
        env = dict(os.environ, KERAS_BACKEND=backend)
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"| {backend} | failed | {done.stderr.strip()[-300:]!r} |")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        for name, value in rows_of(result):
            print(f"| {backend} | {name} | {value} |")


if __name__ == "__main__":
    main()
