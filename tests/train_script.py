"""A training script run in its own process by the tests, to be killed.

Prints one `EVENT {json}` line at train begin (after any restore), at every
epoch end, and when fit() returns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
from conftest import make_data, make_model  # noqa: E402

import keras_ft  # noqa: E402


def emit(kind: str, **fields) -> None:
    print("EVENT " + json.dumps({"kind": kind, **fields}), flush=True)


def steps(model: keras.Model) -> int:
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class Reporter(keras.callbacks.Callback):
    def __init__(self, raise_at_epoch_end: int | None, seconds_per_batch: float):
        super().__init__()
        self.raise_at_epoch_end = raise_at_epoch_end
        self.seconds_per_batch = seconds_per_batch
        self.first_epoch = None
        self.reported_first_batch = False

    def on_train_begin(self, logs=None):
        emit("begin", step=steps(self.model))

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_epoch is None:
            self.first_epoch = epoch
            emit("first_epoch", epoch=epoch, step=steps(self.model))

    def on_train_batch_end(self, batch, logs=None):
        if not self.reported_first_batch:
            self.reported_first_batch = True
            emit("first_batch_end", step=steps(self.model))
        if self.seconds_per_batch:
            time.sleep(self.seconds_per_batch)

    def on_epoch_end(self, epoch, logs=None):
        emit("epoch_end", epoch=epoch, step=steps(self.model))
        if epoch + 1 == self.raise_at_epoch_end:
            raise RuntimeError(f"Interrupting at the end of epoch {epoch + 1}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--raise-at-epoch-end", type=int)
    parser.add_argument("--seconds-per-batch", type=float, default=0.0)
    parser.add_argument("--keep-backup", action="store_true")
    parser.add_argument("--goodput-file", default=None)
    parser.add_argument("--grace-period", type=float, default=25.0)
    parser.add_argument("--units", type=int, default=8)
    args = parser.parse_args()
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    x, y = make_data()
    model = make_model(units=args.units)
    history = model.fit(
        x,
        y,
        epochs=args.epochs,
        batch_size=16,
        verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(
                args.backup_dir,
                save_freq=save_freq,
                delete_checkpoint=not args.keep_backup,
                grace_period=args.grace_period,
                goodput_file=args.goodput_file,
            ),
            Reporter(args.raise_at_epoch_end, args.seconds_per_batch),
        ],
    )
    emit("done", step=steps(model), history_epochs=history.epoch)


if __name__ == "__main__":
    main()
