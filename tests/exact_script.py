"""Seeded training with Dropout and shuffling, for the exact-resume proofs.

Run by tests/test_exact_resume.py, once uninterrupted and once SIGKILLed (by
itself, at a chosen point, so the point is exact) and resumed. Writes the final
weights, optimizer variables and best-model weights to OUT.npz, and counters,
learning rate and history to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

import keras
import numpy as np

import keras_ft

SAMPLES, BATCH, FEATURES = 96, 16, 8


class KillSelf(keras.callbacks.Callback):
    def __init__(
        self, after_batch: str | None, at_epoch_begin: int | None, at_begin: bool
    ):
        super().__init__()
        # At the next batch's begin, and async-safe: where every callback is,
        # Keras calls the batch ends on a thread of its own (JAX).
        self.async_safe = at_begin
        self.thread = threading.get_ident()
        self.off_thread = set()
        self.after_batch = (
            tuple(map(int, after_batch.split(":"))) if after_batch else None
        )
        self.at_epoch_begin = at_epoch_begin
        self.epoch = 0
        self.first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.first_epoch is None:
            self.first_epoch = epoch
        if epoch == self.at_epoch_begin:
            self.kill()

    def on_train_batch_begin(self, batch, logs=None):
        if self.async_safe and self.after_batch == (self.epoch, batch):
            self.kill()

    def on_train_batch_end(self, batch, logs=None):
        self.off_thread.add(threading.get_ident() != self.thread)
        if not self.async_safe and self.after_batch == (self.epoch, batch + 1):
            self.kill()

    def kill(self):
        # Once the background write is committed, so the point is exact.
        keras_ft.wait_for_backups()
        os.kill(os.getpid(), signal.SIGKILL)


class Batches(keras.utils.PyDataset):
    """A PyDataset whose batches draw NumPy noise, like an augmentation."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        noise = np.random.normal(scale=0.01, size=self.x[part].shape)
        return (self.x[part] + noise).astype("float32"), self.y[part]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backup-dir")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--kill-after-batch", help="EPOCH:BATCHES_DONE")
    parser.add_argument("--kill-at-epoch-begin", type=int)
    parser.add_argument("--kill-at-batch-begin", action="store_true")
    parser.add_argument("--stateful-callbacks", action="store_true")
    parser.add_argument("--snapshot", default="auto")
    parser.add_argument(
        "--input", default="numpy",
        choices=["numpy", "numpy-unshuffled", "numpy-weighted", "pydataset",
                 "tf.data", "dataloader"],
    )  # fmt: skip
    parser.add_argument("--steps-per-execution", type=int, default=1)
    args = parser.parse_args()

    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    x_val = rng.normal(size=(32, FEATURES)).astype("float32")
    y_val = rng.normal(size=(32, 1)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-2),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=args.steps_per_execution,
    )

    callbacks = []
    if args.backup_dir:
        save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
        callbacks.append(
            keras_ft.BackupAndRestore(
                args.backup_dir,
                save_freq=save_freq,
                delete_checkpoint=False,
                snapshot=args.snapshot,
            )
        )
    kill = KillSelf(
        args.kill_after_batch, args.kill_at_epoch_begin, args.kill_at_batch_begin
    )
    callbacks.append(kill)
    best_path = args.out + ".best.weights.h5"
    if args.stateful_callbacks:
        callbacks += [
            # min_delta so large that nothing improves: stops at epoch 4 (0-based).
            keras.callbacks.EarlyStopping(
                monitor="val_loss", patience=3, min_delta=1e6
            ),
            # Halves the rate at every epoch after the first.
            keras.callbacks.ReduceLROnPlateau(
                monitor="loss", patience=1, factor=0.5, min_delta=1e6, min_lr=1e-9
            ),
            # The loss falls, so with mode="max" the first epoch stays the best
            # and must never be overwritten, before or after a restart.
            keras.callbacks.ModelCheckpoint(
                best_path, monitor="loss", mode="max", save_best_only=True,
                save_weights_only=True,
            ),
        ]  # fmt: skip
    inputs = {"x": x, "y": y, "batch_size": BATCH, "shuffle": True}
    validation = {"validation_data": (x_val, y_val)}
    if args.input == "numpy-unshuffled":
        inputs["shuffle"] = False
    elif args.input == "numpy-weighted":
        # Arrays as many scripts pass them: per-sample weights, and the
        # validation rows split off the end of x (before any shuffle).
        weights = rng.uniform(0.5, 2.0, size=(SAMPLES * 5 // 4,)).astype("float32")
        x_all = np.concatenate([x, x_val[: SAMPLES // 4]])
        y_all = np.concatenate([y, y_val[: SAMPLES // 4]])
        inputs = {"x": x_all, "y": y_all, "sample_weight": weights,
                  "batch_size": BATCH, "shuffle": True}  # fmt: skip
        validation = {"validation_split": 0.2}
    elif args.input == "pydataset":
        inputs = {"x": Batches(x, y), "shuffle": True}
    elif args.input == "dataloader":
        import torch

        # keras.utils.set_random_seed() seeds PyTorch on its backend only.
        torch.manual_seed(7)
        pairs = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
        loader = torch.utils.data.DataLoader(pairs, batch_size=BATCH, shuffle=True)
        inputs = {"x": loader}
    elif args.input == "tf.data":
        import tensorflow as tf

        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        dataset = dataset.shuffle(SAMPLES, seed=3).batch(BATCH)
        inputs = {"x": dataset, "shuffle": False}
    history = model.fit(
        **inputs,
        epochs=args.epochs,
        **validation,
        verbose=0,
        callbacks=callbacks,
    )
    arrays = {
        f"w{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.weights)
    }
    for i, v in enumerate(model.optimizer.variables):
        arrays[f"opt{i}"] = keras.ops.convert_to_numpy(v)
    if os.path.exists(best_path):
        best = keras.models.clone_model(model)
        best.load_weights(best_path)
        for i, w in enumerate(best.get_weights()):
            arrays[f"best{i}"] = w
    np.savez(args.out + ".npz", **arrays)
    with open(args.out + ".json", "w") as f:
        json.dump(
            {
                "iterations": int(
                    keras.ops.convert_to_numpy(model.optimizer.iterations)
                ),
                "learning_rate": float(
                    keras.ops.convert_to_numpy(model.optimizer.learning_rate)
                ),
                "history": history.history,
                "epochs": history.epoch,
                "first_epoch": kill.first_epoch,
                "batch_ends_off_thread": sorted(kill.off_thread),
            },
            f,
        )


if __name__ == "__main__":
    main()
