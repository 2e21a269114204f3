"""KerasHub fine-tunes as users run them, for the exact-resume proofs.

Run by tests/test_workloads.py. Trains a small `GPT2CausalLM` built from a
config (nothing downloaded) once per recipe, each with AdamW, a cosine
schedule and dropout: LoRA with `gradient_accumulation_steps=3`; int8 +
LoRA with `use_ema=True`; `mixed_float16` (a LossScaleOptimizer). With `--crash-after
EPOCH:BATCHES_DONE`, each recipe's training is stopped there once its backup
is committed: every recipe but the last by an exception (a crash that leaves
the process alive), the last by SIGKILL. Run again, each resumes from its own
backup. `--snapshot` is `BackupAndRestore`'s `snapshot`. Writes each
recipe's variables to OUT.npz and its counters and variable paths to
OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings

import keras
import numpy as np

import keras_ft

RECIPES = ["lora-accumulate", "int8-lora-ema", "mixed"]
SAMPLES, BATCH, LENGTH, VOCABULARY = 48, 8, 12, 256
EPOCHS = 2


class Crash(Exception):
    pass


class CrashAfter(keras.callbacks.Callback):
    def __init__(self, where: tuple[int, int] | None, kill: bool):
        super().__init__()
        self.where, self.kill, self.epoch = where, kill, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.where == (self.epoch, batch + 1):
            keras_ft.wait_for_backups()  # The point is exact: committed.
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise Crash(f"crashed after batch {batch + 1} of epoch {self.epoch}")


def causal_lm(recipe: str) -> keras.Model:
    import keras_hub

    keras.utils.set_random_seed(11)
    keras.mixed_precision.set_global_policy(
        "mixed_float16" if recipe == "mixed" else "float32"
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=LENGTH,
        dropout=0.1,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if recipe.startswith("int8"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Layers that do not quantize.
            model.quantize("int8")
    if "lora" in recipe:
        backbone.enable_lora(4)
    schedule = keras.optimizers.schedules.CosineDecay(
        1e-3, decay_steps=EPOCHS * SAMPLES // BATCH, alpha=0.1
    )
    optimizer = keras.optimizers.AdamW(
        schedule,
        weight_decay=0.01,
        gradient_accumulation_steps=3 if "accumulate" in recipe else None,
        use_ema="ema" in recipe,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backup-dir")
    parser.add_argument("--crash-after", help="EPOCH:BATCHES_DONE")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--snapshot", default="auto")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    where = tuple(map(int, args.crash_after.split(":"))) if args.crash_after else None
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, (SAMPLES, LENGTH + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    y = tokens[:, 1:]
    arrays, summary = {}, {}
    for recipe in recipes:
        model = causal_lm(recipe)
        callbacks = [CrashAfter(where, kill=recipe == recipes[-1])]
        if args.backup_dir:
            callbacks.insert(
                0,
                keras_ft.BackupAndRestore(
                    os.path.join(args.backup_dir, recipe),
                    save_freq=2,
                    snapshot=args.snapshot,
                ),
            )
        try:
            model.fit(
                x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks
            )
        except Crash:
            continue
        optimizer = model.optimizer
        variables = list(model.weights) + list(optimizer.variables)
        for i, variable in enumerate(variables):
            arrays[f"{recipe}/{i}"] = keras.ops.convert_to_numpy(variable)
        summary[recipe] = {
            "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations)),
            "optimizer_paths": [v.path for v in optimizer.variables],
            "optimizer": type(optimizer).__name__,
        }
    keras.mixed_precision.set_global_policy("float32")
    np.savez(args.out + ".npz", **arrays)
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
