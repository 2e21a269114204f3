"""fit() on one stream across epochs: an endless Python generator, a
repeated tf.data pipeline, or arrays, a PyDataset or a PyTorch DataLoader of
more batches than an epoch takes, read with steps_per_epoch (Keras does not
restart it at an epoch's begin; the finite ones run out every other epoch
here, and start again at the next).

Run by tests/test_inputs.py: uninterrupted, and SIGKILLed by itself at a
chosen batch (after the backups are in) then run again. Writes OUT.npz.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
from script_callbacks import KillAt

import keras_ft

SAMPLES, BATCH, STEPS, EPOCHS = 64, 8, 5, 4  # 8 batches a pass, 5 an epoch.


class Noisy(keras.utils.PyDataset):
    """Batches with NumPy noise drawn as each loads, like an augmentation."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return SAMPLES // BATCH

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        noise = np.random.normal(scale=0.01, size=self.x[part].shape)
        return (self.x[part] + noise).astype("float32"), self.y[part]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("out")
    parser.add_argument(
        "--input",
        choices=["generator", "repeat", "arrays", "pydataset", "dataloader"],
    )
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--kill-at", default=None, help="EPOCH:BATCH")
    args = parser.parse_args()
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    if args.input == "generator":

        def endless():
            start = 0
            while True:  # Each pass in another order, drawn as it goes.
                order = np.random.permutation(SAMPLES)
                for i in range(0, SAMPLES, BATCH):
                    part = order[i : i + BATCH]
                    # Noise drawn for every batch, on TensorFlow in a tf.data
                    # thread that loads ahead of training.
                    noise = np.random.normal(scale=0.01, size=x[part].shape)
                    yield (x[part] + noise).astype("float32"), y[part]
                start += 1

        data = endless()
    elif args.input == "arrays":
        data = {"x": x, "y": y, "batch_size": BATCH, "shuffle": True}
    elif args.input == "pydataset":
        data = {"x": Noisy(x, y), "shuffle": True}
    elif args.input == "dataloader":
        import torch

        # keras.utils.set_random_seed() seeds PyTorch on its backend only.
        torch.manual_seed(5)
        pairs = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
        data = torch.utils.data.DataLoader(pairs, batch_size=BATCH, shuffle=True)
    else:
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ],  # fmt: skip
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    save_freq = int(args.save_freq) if args.save_freq.isdigit() else args.save_freq
    at = tuple(map(int, args.kill_at.split(":"))) if args.kill_at else None
    backup = keras_ft.BackupAndRestore(args.backup_dir, save_freq=save_freq, verbose=0)
    data = data if isinstance(data, dict) else {"x": data}
    model.fit(
        **data, steps_per_epoch=STEPS, epochs=EPOCHS, verbose=0,
        callbacks=[backup, KillAt(at)],
    )  # fmt: skip
    np.savez(args.out + ".npz", *[np.asarray(w) for w in model.get_weights()])


if __name__ == "__main__":
    main()
