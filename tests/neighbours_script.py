"""A seeded fit() with Keras' stock callbacks beside the backup.

Run by tests/test_neighbours.py: once uninterrupted, and once SIGKILLed by
itself at a chosen batch (after a backup, so the killed run has written
logs, rows and checkpoints past it) and run again. Writes OUT.npz (the final
weights) and OUT.json (the learning rate each trained batch saw, the epochs
of History). The callbacks' own files are under WORK.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import keras
import numpy as np
from script_callbacks import KillAt, Unsaved

import keras_ft

SAMPLES, BATCH, FEATURES, EPOCHS = 64, 8, 4, 4


class Rates(Unsaved):
    """The learning rate at each batch it is shown, (epoch, batch, rate)."""

    def __init__(self):
        super().__init__()
        self.seen, self.epoch = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self.seen.append([self.epoch, batch, rate])


def schedule(epoch, lr):  # Keras' own docs' example.
    return lr if epoch < 2 else lr * math.exp(-0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("out")
    parser.add_argument("--kill-at", default=None, help="EPOCH:BATCH")
    parser.add_argument("--backup-first", action="store_true")
    parser.add_argument("--save-freq", type=int, default=3)
    parser.add_argument("--update-freq", default="batch")
    parser.add_argument("--append", action="store_true")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    args = parser.parse_args()
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    x_val, y_val = x[:16] + 0.5, y[:16]
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(
            0.01, use_ema=True, ema_overwrite_frequency=None
        ),
        loss="mse",
        steps_per_execution=args.steps_per_execution,
    )
    work = args.work
    backup = keras_ft.BackupAndRestore(
        os.path.join(work, "backup"), save_freq=args.save_freq, verbose=0
    )
    rates = Rates()
    stock = [
        keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
        keras.callbacks.LearningRateScheduler(schedule),
        keras.callbacks.ModelCheckpoint(
            os.path.join(work, "ckpt", "ep{epoch:02d}-b{batch:02d}.weights.h5"),
            save_weights_only=True,
            save_freq=4,
        ),
        keras.callbacks.CSVLogger(os.path.join(work, "log.csv"), append=args.append),
        keras.callbacks.TensorBoard(
            os.path.join(work, "tb"),
            update_freq=int(args.update_freq)
            if args.update_freq.isdigit()
            else args.update_freq,
        ),
        rates,
    ]
    at = tuple(map(int, args.kill_at.split(":"))) if args.kill_at else None
    if args.backup_first:
        callbacks = [backup, *stock, KillAt(at)]
    else:
        callbacks = [*stock, backup, KillAt(at)]
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=0,
    )
    np.savez(args.out + ".npz", *[np.asarray(w) for w in model.get_weights()])
    with open(args.out + ".json", "w") as f:
        json.dump({"rates": rates.seen, "epochs": history.epoch}, f)


if __name__ == "__main__":
    main()
