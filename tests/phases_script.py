"""A two-phase script: fit(), compile() with a new optimizer, fit() again,
one backup for both (the same callback, or a new one on the same dir).

Run by tests/test_fit_begin.py: uninterrupted, and SIGKILLed in phase 2
(by itself, after a backup) then run again. Writes OUT.npz (the final
weights) and OUT.json (the batches each phase trained in this process).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import keras
import numpy as np
from script_callbacks import Unsaved

import keras_ft


class Trained(Unsaved):
    def __init__(self, kill_at: int | None):
        super().__init__()
        self.batches, self.kill_at = 0, kill_at

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches == self.kill_at:
            keras_ft.wait_for_backups()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("out")
    parser.add_argument("--kill-in-phase-2-at", type=int, default=None)
    parser.add_argument("--new-callback", action="store_true")
    args = parser.parse_args()
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    backup = keras_ft.BackupAndRestore(args.backup_dir, save_freq=2, verbose=0)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    first = Trained(None)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[backup, first], verbose=0)
    model.layers[0].trainable = False
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    if args.new_callback:
        backup = keras_ft.BackupAndRestore(args.backup_dir, save_freq=2, verbose=0)
    second = Trained(args.kill_in_phase_2_at)
    model.fit(x, y, batch_size=8, epochs=3, callbacks=[backup, second], verbose=0)
    np.savez(args.out + ".npz", *[np.asarray(w) for w in model.get_weights()])
    with open(args.out + ".json", "w") as f:
        json.dump({"phase_1": first.batches, "phase_2": second.batches}, f)


if __name__ == "__main__":
    main()
