"""A KerasHub LoRA fine-tune on a preemptible machine.

A spot VM or a preemptible job gets SIGTERM and some seconds before it goes.
`keras_ft.BackupAndRestore` finishes the batch in flight, backs up that exact
step (the LoRA factors as trained, the frozen kernel as it was, AdamW's
moments, the schedule's step, the dropout RNG) and exits with status 143, so
the scheduler knows to run the job again. Run again, the script resumes at
that batch:

    python examples/finetune_lora.py --backup-dir /tmp/lora-backup
    # ... SIGTERM (kill -TERM <pid>, or the cloud's preemption notice) ...
    python examples/finetune_lora.py --backup-dir /tmp/lora-backup

The model is a small GPT-2 built from a config and the data is synthetic, so
nothing is downloaded; a real fine-tune builds the model with
`keras_hub.models.GPT2CausalLM.from_preset(...)` and reads its own data, and
the callback is used the same way.
"""

from __future__ import annotations

import argparse

import keras
import keras_hub
import numpy as np

import keras_ft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backup-dir", default="/tmp/keras-ft-lora")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=640)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=1024,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=32,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(rank=4)  # Only the LoRA factors train.

    steps = args.epochs * args.samples // 8
    model.compile(
        optimizer=keras.optimizers.AdamW(
            keras.optimizers.schedules.CosineDecay(5e-4, decay_steps=steps)
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 1024, (args.samples, 33)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    y = tokens[:, 1:]

    model.fit(
        x,
        y,
        batch_size=8,
        epochs=args.epochs,
        verbose=2,
        callbacks=[
            # Every 10 batches, and at the exact step a SIGTERM arrives.
            keras_ft.BackupAndRestore(args.backup_dir, save_freq=10),
        ],
    )
    print("fine-tune finished")


if __name__ == "__main__":
    main()
