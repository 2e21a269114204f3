"""Continuous evaluation: one process trains, another evaluates each backup.

    python examples/evaluate_while_training.py [--epochs 20] [--dir /tmp/eval-demo]

starts the trainer (this script with `train`) in a subprocess and evaluates
in this process: every checkpoint the trainer commits is loaded, as soon as
it is committed, into a second model, evaluated on held-out data, and the
loss written to TensorBoard (`<dir>/logs/validation`, tag
`evaluation_loss_vs_iterations`, on the trainer's optimizer step):

    tensorboard --logdir /tmp/eval-demo/logs

The evaluator only reads the backup: it never locks or changes it, and does
not slow the trainer beyond reading each checkpoint once. A checkpoint the
trainer's retention (`keep=2`) deleted before the evaluator got to it is
passed over. The data are synthetic, made here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import keras
import numpy as np

import keras_ft


def make_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    return model


def make_data(seed: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 16)).astype("float32")
    w = np.linspace(-1, 1, 16, dtype="float32")[:, None]
    return x, (x @ w + 0.1 * rng.normal(size=(samples, 1))).astype("float32")


class SlowSteps(keras.callbacks.Callback):
    """Makes each step take `seconds` longer: a bigger model's pace."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def train(backup_dir: str, epochs: int, step_seconds: float) -> None:
    x, y = make_data(seed=0, samples=4096)
    make_model().fit(
        x, y, epochs=epochs, batch_size=64, verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(
                backup_dir, save_freq=32, keep=2, delete_checkpoint=False
            ),
            SlowSteps(step_seconds),
        ],
    )  # fmt: skip
    print("trainer: done", flush=True)


def evaluate(backup_dir: str, logdir: str, trainer: subprocess.Popen) -> int:
    x_val, y_val = make_data(seed=1, samples=1024)
    model = make_model()
    model.optimizer.build(model.trainable_variables)  # Its step is loaded too.
    tensorboard = keras.callbacks.TensorBoard(logdir)
    evaluated = 0
    # Waits for each next checkpoint as long as the trainer runs; once it has
    # exited and a second passed without a new one, the iteration ends.
    for checkpoint in keras_ft.watch(
        backup_dir, timeout=1.0, poll_seconds=0.2,
        timeout_fn=lambda: trainer.poll() is not None,
    ):  # fmt: skip
        try:
            keras_ft.load_checkpoint(checkpoint, model)
        except keras_ft.CheckpointError as e:  # Pruned before we read it.
            print(f"evaluator: skipped {checkpoint.path}: {e}", flush=True)
            continue
        loss = model.evaluate(x_val, y_val, verbose=0, callbacks=[tensorboard])
        evaluated += 1
        print(
            f"evaluator: step {checkpoint.step:5d} (epoch {checkpoint.epoch}, "
            f"batch {checkpoint.batch}): validation loss {loss:.4f}",
            flush=True,
        )
    return evaluated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="both", choices=["both", "train"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--dir", default="/tmp/eval-demo")
    parser.add_argument(
        "--step-seconds", type=float, default=0.02,
        help="added to each training step, as a bigger model would take",
    )  # fmt: skip
    args = parser.parse_args()
    backup_dir = os.path.join(args.dir, "backup")
    if args.mode == "train":
        train(backup_dir, args.epochs, args.step_seconds)
        return
    trainer = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "train",
         "--epochs", str(args.epochs), "--dir", args.dir,
         "--step-seconds", str(args.step_seconds)],
    )  # fmt: skip
    try:
        evaluated = evaluate(backup_dir, os.path.join(args.dir, "logs"), trainer)
    finally:
        status = trainer.wait()
    print(f"evaluator: evaluated {evaluated} checkpoints; trainer exit {status}")
    sys.exit(status)


if __name__ == "__main__":
    main()
