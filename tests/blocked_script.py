"""A training whose main thread gets stuck, for tests/test_watchdog.py.

    python blocked_script.py BACKUP_DIR --block-at 6 --how python|c
        [--stall-timeout S] [--grace-period S]

Trains a small model saving every 2 batches; after batch `--block-at` of the
second epoch the main thread blocks for good: in Python (`Event.wait()`,
where a signal handler still runs), or in C (a second `pthread_mutex_lock`
of a mutex it holds, through ctypes, as a thread blocked inside a collective
is: no Python signal handler runs). Prints `BLOCKED` once blocked.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading

import keras
import numpy as np

import keras_ft


def block(how: str) -> None:
    print("BLOCKED", flush=True)
    if how == "python":
        threading.Event().wait()
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER: zeros.
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # Never returns, whatever signal comes.


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("--block-at", type=int, default=0)
    parser.add_argument("--how", default="python")
    parser.add_argument("--stall-timeout", type=float, default=None)
    parser.add_argument("--grace-period", type=float, default=25.0)
    args = parser.parse_args()

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    x = np.random.default_rng(0).normal(size=(128, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    class Block(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch + 1 == args.block_at:
                keras_ft.wait_for_backups()
                block(args.how)

    backup = keras_ft.BackupAndRestore(
        args.backup_dir,
        save_freq=2,
        async_save=False,
        grace_period=args.grace_period,
        stall_timeout=False if args.stall_timeout is None else args.stall_timeout,
        first_batch_timeout=120,
    )
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[backup, Block()])
    print("FINISHED", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
