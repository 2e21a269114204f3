"""A seeded fit() that sends itself SIGTERM at a chosen moment: in
validation at an epoch's end, before its first step runs (compiling), or
inside another callback's on_epoch_end; a LearningRateScheduler beside it.

Run by tests/test_preemption.py: uninterrupted, and signalled (it ends
with 128 + SIGTERM after its final backup) then run again. Writes OUT.npz
and, on the signalled run, nothing.
"""

from __future__ import annotations

import argparse
import os
import signal

import keras
import numpy as np
from script_callbacks import Unsaved

import keras_ft


class Signal(Unsaved):
    def __init__(self, at: str | None):
        super().__init__()
        self.at, self.epoch, self.sent = at, 0, False

    def send(self, where: str) -> None:
        if self.at == where and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == 0 and batch == 0:
            self.send("first_step")  # Handled as the step compiles and runs.

    def on_test_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 1:
            self.send("validation")

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.send("epoch_end")


def Decay() -> keras.callbacks.LearningRateScheduler:
    """Keras' documented schedule, from the second epoch on: the rate an
    epoch trains at depends on the one before it."""
    return keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: lr if epoch < 1 else lr * float(np.exp(-0.5))
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("out")
    parser.add_argument("--signal-at", default=None)
    parser.add_argument("--save-freq", default="epoch")
    args = parser.parse_args()
    keras.utils.set_random_seed(11)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
         keras.layers.Dropout(0.1), keras.layers.Dense(1)]
    )  # fmt: skip
    model.compile(keras.optimizers.Adam(0.01), "mse")
    save_freq = int(args.save_freq) if args.save_freq.isdigit() else args.save_freq
    backup = keras_ft.BackupAndRestore(
        args.backup_dir, save_freq=save_freq, verbose=0, grace_period=20
    )
    model.fit(
        x, y, batch_size=8, epochs=3, validation_data=(x[:32], y[:32]),
        validation_batch_size=8, verbose=0,
        callbacks=[backup, Signal(args.signal_at), Decay()],
    )  # fmt: skip
    np.savez(args.out + ".npz", *[np.asarray(w) for w in model.get_weights()])


if __name__ == "__main__":
    main()
