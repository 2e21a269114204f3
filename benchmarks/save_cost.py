"""Cost of a backup: keras-ft vs `keras.callbacks.BackupAndRestore` vs nothing.

Measures, side by side in one run on the current backend (`KERAS_BACKEND`):
1. seconds per save and bytes per checkpoint, ~5M-parameter MLP with Adam,
   against the raw cost of writing and fsync'ing the same bytes;
2. seconds per restore;
3. `fit()` time saving every batch: no callback, Keras' own, keras-ft with
   synchronous saves, keras-ft with background saves (the default).

Prints medians over repeats with the spread (min-max). Run: `make bench`, or
`KERAS_BACKEND=jax python benchmarks/save_cost.py --repeats 5`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import keras
import numpy as np

import keras_ft


def build_model(width: int) -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-4), loss="mse")
    return model


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times):8.3f} s  ({min(times):.3f}-{max(times):.3f})"


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )


def raw_write(path: str, nbytes: int) -> None:
    block = np.random.default_rng(0).bytes(nbytes)
    with open(path, "wb") as f:
        f.write(block)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--fit-steps", type=int, default=20)
    args = parser.parse_args()

    model = build_model(args.width)
    x = np.random.default_rng(0).normal(size=(32 * args.fit_steps, 512))
    y = np.zeros((len(x), 10))
    x, y = x.astype("float32"), y.astype("float32")
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    params = model.count_params()
    root = tempfile.mkdtemp(prefix="keras-ft-bench-")
    rows = []
    try:
        ft_dir = os.path.join(root, "ft")
        state = keras_ft.WorkerTrainingState(model, ft_dir, keep=1)
        ft_save = timed(lambda: state.back_up(0), args.repeats)
        ft_bytes = dir_bytes(os.path.join(ft_dir, "chief"))
        ft_restore = timed(state.restore, args.repeats)

        keras_dir = os.path.join(root, "keras")
        keras_cb = keras.callbacks.BackupAndRestore(keras_dir)
        keras_cb.set_model(model)
        keras_save = timed(keras_cb._save_model, args.repeats)
        keras_bytes = dir_bytes(keras_dir)
        keras_restore = timed(keras_cb._load_model, args.repeats)

        raw_path = os.path.join(root, "raw.bin")
        raw = timed(lambda: raw_write(raw_path, ft_bytes), args.repeats)

        def fit_with(callbacks):
            fresh = build_model(args.width)
            fresh.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
            return timed(
                lambda: fresh.fit(
                    x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks()
                ),
                args.repeats,
            )

        fit_none = fit_with(list)
        fit_keras = fit_with(
            lambda: [
                keras.callbacks.BackupAndRestore(
                    os.path.join(root, "fit-keras"), save_freq=1
                )
            ]
        )
        fit_ft = fit_with(
            lambda: [
                keras_ft.BackupAndRestore(
                    os.path.join(root, "fit-ft"),
                    save_freq=1,
                    verbose=0,
                    async_save=False,
                )
            ]
        )
        fit_ft_async = fit_with(
            lambda: [
                keras_ft.BackupAndRestore(
                    os.path.join(root, "fit-ft-async"), save_freq=1, verbose=0
                )
            ]
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    print(
        f"\nbackend={keras.backend.backend()}  parameters={params:,}  "
        f"repeats={args.repeats}  (median, min-max)\n"
    )
    rows = [
        ("save, keras-ft", fmt(ft_save), f"{ft_bytes / 1e6:.1f} MB"),
        (
            "save, Keras BackupAndRestore",
            fmt(keras_save),
            f"{keras_bytes / 1e6:.1f} MB",
        ),
        ("raw write+fsync, same bytes", fmt(raw), ""),
        ("restore, keras-ft (verifies SHA-256)", fmt(ft_restore), ""),
        ("restore, Keras BackupAndRestore", fmt(keras_restore), ""),
        (f"fit {args.fit_steps} steps, no callback", fmt(fit_none), "1.00x"),
        (
            "fit, Keras saving every batch",
            fmt(fit_keras),
            f"{med(fit_keras) / med(fit_none):.2f}x",
        ),
        (
            "fit, keras-ft sync saving every batch",
            fmt(fit_ft),
            f"{med(fit_ft) / med(fit_none):.2f}x",
        ),
        (
            "fit, keras-ft async saving every batch",
            fmt(fit_ft_async),
            f"{med(fit_ft_async) / med(fit_none):.2f}x",
        ),
    ]
    for name, value, extra in rows:
        print(f"{name:40s} {value:30s} {extra}")
    added = {
        name: med(times) - med(fit_none)
        for name, times in [
            ("keras", fit_keras),
            ("sync", fit_ft),
            ("async", fit_ft_async),
        ]
    }
    print(
        f"\nkeras-ft save / raw write+fsync: {med(ft_save) / med(raw):.2f}x;  "
        f"keras-ft save / Keras save: {med(ft_save) / med(keras_save):.2f}x\n"
        f"added fit time vs Keras' own: sync {added['sync'] / added['keras']:.2f}x, "
        f"async {added['async'] / added['keras']:.2f}x"
    )


if __name__ == "__main__":
    main()
