"""A multi-worker training that torchrun (or SLURM) brings back after a worker dies.

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 \\
        examples/multiworker_torchrun.py --backup-dir /tmp/torchrun-backup

or in an `sbatch --requeue` script (docs/cluster.md): `srun
--kill-on-bad-exit=1 python examples/multiworker_torchrun.py --backup-dir
/shared/backup || scontrol requeue $SLURM_JOB_ID`.

torchrun (TorchElastic, installed with the PyTorch backend) launches any
Python script: here two processes of a TensorFlow (`MultiWorkerMirroredStrategy`)
or JAX (`DataParallel`) training, set up from torchrun's environment by
`keras_ft.initialize_cluster()`. When a worker dies, torchrun stops the others
and starts the group again, up to `--max-restarts` times; every process
resumes from the chief's last backup at the same step. A stuck worker ends
itself with exit status 75 (`stall_timeout`), which torchrun restarts too.

`--kill-at STEP` makes worker 1 SIGKILL itself at that optimizer step on the
first attempt, to watch a restart; `--block-at STEP` makes it hang for good
there (a deadlock, a stalled read), to watch `--stall-timeout` end the job;
`--out PREFIX` writes each worker's final step and weights to
`PREFIX-<rank>.npz` (for the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time

import keras_ft  # Imports neither Keras nor a backend.

SAMPLES, GLOBAL_BATCH, EPOCHS = 128, 16, 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--seconds-per-batch", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--block-at", type=int, default=0)
    parser.add_argument("--stall-timeout", type=float, default=None)
    parser.add_argument("--grace-period", type=float, default=25.0)
    # Keeps the backup (and its goodput records) once the training is done.
    parser.add_argument("--keep-backup", action="store_true")
    args = parser.parse_args()

    # First, before any other framework call: the cluster from torchrun.
    task = keras_ft.initialize_cluster()
    import keras
    import numpy as np

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        scope = tf.distribute.MultiWorkerMirroredStrategy().scope()
    else:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False)
        )
        scope = contextlib.nullcontext()
    keras.utils.set_random_seed(7)
    with scope:
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
             keras.layers.Dense(1)]
        )  # fmt: skip
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    if keras.backend.backend() == "tensorflow":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        data = {"x": dataset, "shuffle": False}
    else:
        data = {"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": False}

    restarts = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    first_attempt = all(os.environ.get(name, "0") == "0" for name in restarts)

    class KillAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if first_attempt and task.task_index == 1 and step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if first_attempt and task.task_index == 1 and step == args.block_at:
                print(f"worker 1: blocked at optimizer step {step}", flush=True)
                threading.Event().wait()
            time.sleep(args.seconds_per_batch)

    backup = keras_ft.BackupAndRestore(
        args.backup_dir, save_freq=2, grace_period=args.grace_period,
        stall_timeout=args.stall_timeout, delete_checkpoint=not args.keep_backup,
    )  # fmt: skip
    model.fit(**data, epochs=args.epochs, verbose=0, callbacks=[backup, KillAt()])
    step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    print(f"worker {task.task_index}: finished at optimizer step {step}", flush=True)
    if args.out:
        weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
        named = {f"w{i}": w for i, w in enumerate(weights)}
        np.savez(f"{args.out}-{task.task_index}.npz", step=step, **named)


if __name__ == "__main__":
    main()
