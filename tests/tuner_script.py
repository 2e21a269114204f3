"""A Keras Tuner search with keras-ft, for tests/test_tuner.py.

RandomSearch (or `--tuner`) over units and learning rate, each trial stopped early by
EarlyStopping after its second epoch (so its backup is kept). With
`--kill-at TRIAL:EPOCH:BATCHES_DONE`, the process SIGKILLs itself there once
the backup is committed; run again, the search goes on (`overwrite=False`).
Writes every trial's hyperparameters and score to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import keras
import keras_tuner
import numpy as np

import keras_ft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--backup-dir")
    parser.add_argument("--kill-at", help="TRIAL:EPOCH:BATCHES_DONE")
    parser.add_argument(
        "--tuner",
        default="RandomSearch",
        choices=("RandomSearch", "BayesianOptimization", "GridSearch", "Hyperband"),
    )
    args = parser.parse_args()
    kill_at = args.kill_at.split(":") if args.kill_at else None
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")

    def build(hp):
        keras.utils.set_random_seed(5)
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(hp.Choice("units", [4, 8]), activation="relu"),
                keras.layers.Dropout(0.3),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        learning_rate = hp.Choice("learning_rate", [1e-2, 1e-3])
        model.compile(keras.optimizers.Adam(learning_rate), "binary_crossentropy")
        return model

    running = {}

    class Tuner(getattr(keras_tuner, args.tuner)):
        def run_trial(self, trial, *fit_args, **fit_kwargs):
            running["trial"] = trial.trial_id
            return super().run_trial(trial, *fit_args, **fit_kwargs)

    class KillSelf(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            here = [running["trial"], str(self.epoch), str(batch + 1)]
            if here == kill_at:
                keras_ft.wait_for_backups()
                os.kill(os.getpid(), signal.SIGKILL)

    budget = {"max_epochs": 4} if args.tuner == "Hyperband" else {"max_trials": 3}
    tuner = Tuner(
        build,
        objective="loss",
        **budget,
        seed=1,
        directory=args.project_dir,
        project_name="search",
        overwrite=False,
    )
    callbacks = [
        keras.callbacks.EarlyStopping("loss", patience=0, min_delta=10),
        KillSelf(),
    ]
    if args.backup_dir:
        callbacks.insert(0, keras_ft.BackupAndRestore(args.backup_dir, save_freq=1))
    tuner.search(x, y, epochs=4, batch_size=16, verbose=0, callbacks=callbacks)
    trials = {
        trial.trial_id: {
            "hyperparameters": trial.hyperparameters.values,
            "score": float(trial.score),
            "best_step": trial.best_step,
        }
        for trial in tuner.oracle.trials.values()
    }
    best = tuner.get_best_hyperparameters(1)[0].values
    with open(args.out, "w") as f:
        json.dump({"trials": trials, "best": best}, f)


if __name__ == "__main__":
    main()
