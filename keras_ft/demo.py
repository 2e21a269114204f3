"""Kill a training process with SIGKILL, start it again, and watch it resume.

Run with `python -m keras_ft.demo` (or `keras-ft demo`, or `make demo`). The
demo trains a small model on data it generates three times, each in its own
process: once uninterrupted, once killed part-way with SIGKILL, and once more
on the same backup directory, which resumes. It then checks that the resumed
training took exactly as many optimizer steps as the uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

_RESULT = "KERAS_FT_DEMO_RESULT "
_EPOCH_DONE = "KERAS_FT_DEMO_EPOCH "
EPOCHS = 8
SAMPLES = 640
BATCH_SIZE = 32


def _train(backup_dir: str, seconds_per_batch: float) -> None:
    """The training process: an ordinary script using the callback."""
    import keras
    import numpy as np

    import keras_ft

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")

    epochs_run: list[int] = []

    class SlowAndTalkative(keras.callbacks.Callback):
        # Stands in for a real model's step time, so a kill lands mid-run.
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(seconds_per_batch)

        def on_epoch_end(self, epoch, logs=None):
            epochs_run.append(epoch)
            print(f"{_EPOCH_DONE}{epoch + 1}", flush=True)

    model.fit(
        x,
        y,
        epochs=EPOCHS,
        batch_size=BATCH_SIZE,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), SlowAndTalkative()],
    )
    result = {
        "first_epoch": epochs_run[0] + 1,
        "epochs_run": len(epochs_run),
        "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "history_epochs": len(model.history.epoch),
        "backend": keras.backend.backend(),
    }
    print(_RESULT + json.dumps(result), flush=True)


def _start(backup_dir: str, seconds_per_batch: float) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_ft.demo",
            "--train",
            backup_dir,
            "--seconds-per-batch",
            str(seconds_per_batch),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _finish(process: subprocess.Popen) -> dict:
    result = None
    for line in process.stdout:
        if line.startswith(_RESULT):
            result = json.loads(line[len(_RESULT) :])
        elif line.startswith("BackupAndRestore:"):
            print("  [training process] " + line.strip())
    if process.wait() != 0 or result is None:
        raise SystemExit(f"The training process failed (exit {process.returncode}).")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keras-ft demo", description=__doc__)
    parser.add_argument("--train", metavar="BACKUP_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--seconds-per-batch", type=float, default=0.01)
    parser.add_argument(
        "--kill-after-epoch",
        type=int,
        default=None,
        help="Epoch after which to SIGKILL the training (default: random 2-5).",
    )
    args = parser.parse_args(argv)
    if args.train:
        _train(args.train, args.seconds_per_batch)
        return 0

    kill_after = args.kill_after_epoch or random.randint(2, EPOCHS - 3)
    steps_per_epoch = -(-SAMPLES // BATCH_SIZE)
    backend = os.environ.get("KERAS_BACKEND", "the default")
    print(
        f"keras-ft demo, {backend} backend: {EPOCHS} epochs of "
        f"{steps_per_epoch} steps, each training in its own process."
    )
    with tempfile.TemporaryDirectory() as root:
        print("1. Training without interruption ...")
        reference = _finish(_start(os.path.join(root, "reference"), 0.0))
        print(
            f"   finished: {reference['epochs_run']} epochs, "
            f"{reference['steps']} optimizer steps."
        )

        backup_dir = os.path.join(root, "backup")
        print(f"2. Training again, backing up to {backup_dir} ...")
        process = _start(backup_dir, args.seconds_per_batch)
        for line in process.stdout:
            if line.startswith(_EPOCH_DONE) and int(line.split()[1]) >= kill_after:
                break
        # Somewhere inside the next epoch, perhaps in the middle of a save.
        time.sleep(random.uniform(0.0, steps_per_epoch * args.seconds_per_batch))
        process.send_signal(signal.SIGKILL)
        process.wait()
        print(
            f"   killed the training process with SIGKILL in epoch "
            f"{kill_after + 1}, after epoch {kill_after} ended."
        )

        print("3. Starting the same training again ...")
        resumed = _finish(_start(backup_dir, args.seconds_per_batch))
        first = resumed["first_epoch"]
        print(
            f"   resumed at epoch {first} and ran epochs {first}-{EPOCHS}; "
            f"finished with {resumed['steps']} optimizer steps; its History "
            f"holds all {resumed['history_epochs']} epochs."
        )
        left = os.path.exists(backup_dir) and os.listdir(backup_dir)
        print(
            f"   backup directory after success: "
            f"{'still holds ' + str(left) if left else 'removed'}."
        )

    same = resumed["steps"] == reference["steps"]
    print(
        f"Result: {resumed['steps']} optimizer steps after the crash and resume, "
        f"{reference['steps']} uninterrupted: "
        f"{'the same. Nothing was lost.' if same else 'DIFFERENT.'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
