"""keras-ft vs Keras' own `OrbaxCheckpoint` (and `BackupAndRestore`, and nothing).

On JAX, one process, one host: `fit()` of a ~6M-parameter MLP with Adam saving
after every batch (or, with `--every-epoch`, a ~50M-parameter MLP saving after
each epoch), side by side in interleaved rounds (medians):

- no callback;
- `keras.callbacks.BackupAndRestore(save_freq=1)`;
- `keras.callbacks.OrbaxCheckpoint(save_freq=1, save_on_background=True)`;
- `keras_ft.BackupAndRestore(save_freq=1)` (asynchronous, the default);

then the time to restore the last save into a fresh model: keras-ft's restore
(`WorkerTrainingState.restore()`, checksums verified) against
`model.load_weights(<orbax dir>)`: from disk (the page cache emptied first,
which needs root; keras-ft writes with direct I/O, so its files are not cached
anyway) and again from the page cache.

Needs `orbax-checkpoint` (installed by `make bench` for this script only).
Run: `python benchmarks/orbax_peer.py [--rounds 3] [--batches 60]`, and
`python benchmarks/orbax_peer.py --every-epoch --epochs 3 --batches 4`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from scaling import drop_page_cache  # noqa: E402

import keras_ft  # noqa: E402

BATCH = 64


# Hidden widths: ~6M parameters (saved every batch) or ~50M (every epoch).
WIDTHS = {"batch": (2048, 1024, 2048), "epoch": (4096, 4096, 4096, 3072)}
EVERY = "batch"


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((1024,))]
        + [keras.layers.Dense(w) for w in WIDTHS[EVERY]]
        + [keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    return model


def fit_seconds(kind: str, directory: str, x, y, epochs: int) -> float:
    model = make_model()
    freq = 1 if EVERY == "batch" else "epoch"
    callbacks = {
        "no callback": [],
        "Keras BackupAndRestore": [
            keras.callbacks.BackupAndRestore(directory, save_freq=freq,
                                             delete_checkpoint=False)
        ],
        "Keras OrbaxCheckpoint": [
            keras.callbacks.OrbaxCheckpoint(directory, save_freq=freq,
                                            save_on_background=True)
        ],
        "keras-ft": [
            keras_ft.BackupAndRestore(directory, save_freq=freq,
                                      delete_checkpoint=False, verbose=0)
        ],
    }[kind]  # fmt: skip
    model.fit(x[:BATCH], y[:BATCH], epochs=1, batch_size=BATCH, verbose=0)  # Compile.
    started = time.perf_counter()
    model.fit(x, y, epochs=epochs, batch_size=BATCH, verbose=0, shuffle=False,
              callbacks=callbacks)  # fmt: skip
    # OrbaxCheckpoint's on_train_end waits for its background saves, and
    # keras-ft's for its own: fit() has returned with every save committed.
    return time.perf_counter() - started


def restore_seconds(kind: str, directory: str) -> float:
    model = make_model()
    model.optimizer.build(model.trainable_variables)
    started = time.perf_counter()
    if kind == "keras-ft":
        keras_ft.WorkerTrainingState(model, directory).restore()
    else:
        model.load_weights(directory)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument(
        "--every-epoch",
        action="store_true",
        help="a ~50M model saved at each of --epochs epochs",
    )
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    global EVERY
    EVERY = "epoch" if args.every_epoch else "batch"
    epochs = args.epochs if args.every_epoch else 1
    saves = epochs if args.every_epoch else args.batches
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * args.batches, 1024)).astype("float32")
    y = rng.normal(size=(BATCH * args.batches, 1)).astype("float32")
    kinds = ["no callback", "Keras BackupAndRestore", "Keras OrbaxCheckpoint",
             "keras-ft"]  # fmt: skip
    fits: dict[str, list[float]] = {k: [] for k in kinds}
    restores: dict[str, list[float]] = {"keras-ft": [], "Keras OrbaxCheckpoint": []}
    cold: dict[str, list[float]] = {kind: [] for kind in restores}
    root = tempfile.mkdtemp(prefix="keras-ft-orbax-bench-")
    try:
        for i in range(args.rounds):
            for kind in kinds if i % 2 == 0 else reversed(kinds):
                directory = os.path.join(root, f"{kind.replace(' ', '_')}-{i}")
                fits[kind].append(fit_seconds(kind, directory, x, y, epochs))
                if kind in restores:
                    keras_ft.wait_for_backups()
                    # From the disk if the page cache can be emptied (root),
                    # then again from the page cache.
                    if drop_page_cache():
                        cold[kind].append(restore_seconds(kind, directory))
                    restores[kind].append(restore_seconds(kind, directory))
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    params = make_model().count_params()
    base = med(fits["no callback"])
    print(
        f"\nJAX, {params / 1e6:.1f}M parameters + Adam, {epochs} x {args.batches} "
        f"batches, a save after every {EVERY}; median of {args.rounds} interleaved "
        "rounds\n"
    )
    print("| callback | fit seconds | added ms per save | × keras-ft's added time |")
    print("|---|---|---|---|")
    ours = (med(fits["keras-ft"]) - base) / saves
    for kind in kinds:
        added = (med(fits[kind]) - base) / saves
        ratio = f"{added / ours:.1f}" if kind != "no callback" and ours > 0 else "-"
        print(f"| {kind} | {med(fits[kind]):.2f} | {added * 1000:.0f} | {ratio} |")
    print("\n| restore of the last save | seconds, from disk | from the page cache |")
    print("|---|---|---|")
    for kind, times in restores.items():
        disk = f"{med(cold[kind]):.3f}" if cold[kind] else "n/a (needs root)"
        print(f"| {kind} | {disk} | {med(times):.3f} |")
    if cold["keras-ft"]:
        ratio = med(cold["Keras OrbaxCheckpoint"]) / med(cold["keras-ft"])
        print(f"\nFrom disk, keras-ft restores {ratio:.1f}x faster than Orbax's.")
    ratio = med(restores["Keras OrbaxCheckpoint"]) / med(restores["keras-ft"])
    print(f"From the page cache, keras-ft restores {ratio:.1f}x faster than Orbax's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
