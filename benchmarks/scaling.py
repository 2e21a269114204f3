"""How save and restore times grow with the model: 5M to 200M parameters.

One process, JAX (`KERAS_BACKEND` to change it), an MLP of N parameters with
Adam (the checkpoint holds 3N floats: weights, both moments). For each size
it times keras-ft's synchronous save (`WorkerTrainingState.back_up()`, copy +
write + fsync + commit) and restore (verify + load), against Keras'
`model.save_weights()` / `model.load_weights()` of the same state, and prints
MB/s: a straight line in bytes means the time per byte stays flat. Restores
are timed from disk (the page cache emptied first, which needs root) and
again from the page cache.

Run: `python benchmarks/scaling.py [--millions 5 20 50 100 200] [--rounds 2]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import keras_ft  # noqa: E402

WIDTH = 4096


def make_model(millions: float) -> keras.Model:
    """An MLP of about `millions` million parameters: square 4096 layers."""
    layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH)))
    width = WIDTH if layers > 1 else int((millions * 1e6) ** 0.5)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, use_bias=False) for _ in range(layers)]
    )
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def drop_page_cache() -> bool:
    """Empties the page cache (needs root): a restore then reads the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        return False
    return True


def one_round(model: keras.Model, root: str, i: int) -> dict[str, float]:
    directory = os.path.join(root, f"ft-{i}")
    state = keras_ft.WorkerTrainingState(model, directory)
    state.prepare()
    state.back_up(0)  # The first save waits for the copy buffer: fit() makes
    # it at train begin, long before a save, so it is not timed here.
    times = {"save": timed(lambda: state.back_up(0))}
    if drop_page_cache():
        times["restore cold"] = timed(state.restore)
    times["restore warm"] = timed(state.restore)
    state.delete_backup()
    path = os.path.join(root, f"keras-{i}.weights.h5")
    times["keras save"] = timed(lambda: model.save_weights(path))
    if drop_page_cache():
        times["keras load cold"] = timed(lambda: model.load_weights(path))
    times["keras load warm"] = timed(lambda: model.load_weights(path))
    os.remove(path)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, nargs="*",
                        default=[5, 20, 50, 100, 200])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="keras-ft-scaling-")
    rows = []
    try:
        for millions in args.millions:
            model = make_model(millions)
            params = model.count_params()
            times: dict[str, list[float]] = {}
            for i in range(args.rounds):
                for key, value in one_round(model, root, i).items():
                    times.setdefault(key, []).append(value)
            checkpoint_mb = 3 * params * 4 / 1e6
            medians = {k: statistics.median(v) for k, v in times.items()}
            rows.append((params, checkpoint_mb, medians))
            model = None  # Freed before the next size is built.
            keras.backend.clear_session()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{keras.backend.backend()}, one process, Adam; median of {args.rounds}; "
          "cold = page cache emptied first (n/a without root)\n")  # fmt: skip
    print(
        "| parameters | checkpoint MB | keras-ft save s | MB/s | restore cold s "
        "| warm s | Keras save_weights s | load_weights cold s | warm s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(t: dict, key: str) -> str:
        return f"{t[key]:.2f}" if key in t else "n/a"

    for params, mb, t in rows:
        print(f"| {params / 1e6:.0f}M | {mb:.0f} | {t['save']:.2f} "
              f"| {mb / t['save']:.0f} | {cell(t, 'restore cold')} "
              f"| {t['restore warm']:.2f} | {t['keras save']:.2f} "
              f"| {cell(t, 'keras load cold')} "
              f"| {t['keras load warm']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
