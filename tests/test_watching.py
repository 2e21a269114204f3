"""watch() and load_checkpoint(): follow a live backup from another process."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from conftest import (
    STEPS_PER_EPOCH,
    checkpoint_entries,
    make_model,
    run_once_on,
    subprocess_env,
    tree_digest,
    weights_of,
)

import keras_ft

_TRAINER = textwrap.dedent(
    """
    import sys, time
    import keras, numpy as np
    import keras_ft

    class Committed(keras_ft.CheckpointListener):
        def after_commit(self, path, epoch, step):
            print("COMMIT", path.rsplit("-", 1)[1], step, flush=True)

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.3)  # A commit lives 1.2 s (keep=2): time to load it.

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[
        keras_ft.BackupAndRestore(sys.argv[1], save_freq=2, keep=2,
                                  delete_checkpoint=False,
                                  listeners=[Committed()]),
        Slow()])
    """
)

_WATCHER = textwrap.dedent(
    """
    import os, sys, warnings
    import keras
    import keras_ft

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.Dense(1)])  # Not compiled.
    print("READY", flush=True)
    # Waits on while the trainer runs (it starts after READY, which can take
    # longer than the timeout on a loaded machine); stops once it is done.
    trainer_done = lambda: os.path.exists(sys.argv[2])
    for checkpoint in keras_ft.watch(
        sys.argv[1], timeout=1, poll_seconds=0.02, timeout_fn=trainer_done
    ):
        try:
            keras_ft.load_checkpoint(checkpoint, model)
            loaded = "loaded"
        except keras_ft.CheckpointError:
            loaded = "pruned"
        print("SEEN", checkpoint.sequence, checkpoint.step, loaded, flush=True)
    """
)


@run_once_on("torch", "two processes on one directory; the backend does not matter")
def test_a_watcher_beside_a_training_sees_every_commit_in_order(tmp_path):
    backup_dir = str(tmp_path / "backup")
    (tmp_path / "trainer.py").write_text(_TRAINER)
    (tmp_path / "watcher.py").write_text(_WATCHER)
    env = subprocess_env()
    done = str(tmp_path / "trainer-done")
    watcher = subprocess.Popen(
        [sys.executable, str(tmp_path / "watcher.py"), backup_dir, done],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert watcher.stdout.readline().strip() == "READY", watcher.stderr.read()
    trainer = subprocess.run(
        [sys.executable, str(tmp_path / "trainer.py"), backup_dir],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert trainer.returncode == 0, trainer.stderr
    open(done, "w").close()
    out, err = watcher.communicate(timeout=120)
    assert watcher.returncode == 0, err
    committed = [
        (int(seq), int(step))
        for _, seq, step in (line.split() for line in trainer.stdout.splitlines())
    ]
    seen = [line.split()[1:] for line in out.splitlines() if line.startswith("SEEN")]
    # Six saves (every 2 of 12 steps), each seen once, in order, verified.
    assert len(committed) == 3 * STEPS_PER_EPOCH // 2
    assert [(int(q), int(s)) for q, s, _ in seen] == committed
    assert "skipping" not in err  # No damaged or partial one, ever.
    # keep=2: only the newest two are left; the watcher read each in time.
    assert len(checkpoint_entries(backup_dir)) == 2 + 1  # + lock.
    assert {state for *_, state in seen} <= {"loaded", "pruned"}


def test_a_damaged_checkpoint_is_skipped_with_a_warning(backup_dir, data):
    x, y = data
    make_model().fit(
        x, y, epochs=3, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, keep=3,
                                             delete_checkpoint=False)],
    )  # fmt: skip
    checkpoints = sorted(glob.glob(os.path.join(backup_dir, "chief", "ckpt-*")))
    weights = os.path.join(checkpoints[1], "model.weights.h5")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) // 2)
        f.write(b"\xff" * 16)
    with pytest.warns(UserWarning, match="skipping .*ckpt-00000002.*checksum"):
        seen = list(keras_ft.watch(backup_dir, timeout=0))
    assert [c.sequence for c in seen] == [1, 3]
    with pytest.raises(keras_ft.CorruptCheckpointError):
        keras_ft.load_checkpoint(checkpoints[1], make_model())


def test_load_checkpoint_reads_a_backup_and_changes_nothing(backup_dir, data):
    x, y = data
    trained = make_model()
    trained.fit(
        x, y, epochs=2, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False)],
    )  # fmt: skip
    keras_ft.wait_for_backups()
    before = tree_digest(backup_dir)
    evaluator = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
         keras.layers.Dense(1)]
    )  # fmt: skip
    found = keras_ft.load_checkpoint(backup_dir, evaluator)  # The newest.
    assert (found.epoch, found.step) == (2, 2 * STEPS_PER_EPOCH)
    for mine, theirs in zip(weights_of(evaluator), weights_of(trained), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    first = os.path.join(backup_dir, "chief", "ckpt-00000001")
    assert keras_ft.load_checkpoint(first, make_model()).step == STEPS_PER_EPOCH
    assert tree_digest(backup_dir) == before


def test_timeout_fn_says_whether_to_keep_waiting(backup_dir, data):
    x, y = data

    def fit(epochs):
        make_model().fit(
            x, y, epochs=epochs, batch_size=16, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False)],
        )  # fmt: skip
        keras_ft.wait_for_backups()

    fit(1)
    calls = []

    def trainer_done():
        calls.append(time.monotonic())
        if len(calls) == 1:
            fit(2)  # The trainer goes on: one more checkpoint while waiting.
            return False
        return len(calls) == 3

    started = time.monotonic()
    seen = keras_ft.watch(
        backup_dir, timeout=0.1, poll_seconds=0.02, timeout_fn=trainer_done
    )
    assert [c.step for c in seen] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert len(calls) == 3 and calls[2] - calls[1] >= 0.1
    assert time.monotonic() - started >= 0.3
    with pytest.raises(ValueError, match="timeout_fn=3"):
        next(keras_ft.watch(backup_dir, timeout=0, timeout_fn=3))


def test_errors_name_the_path(tmp_path):
    with pytest.raises(keras_ft.CheckpointError, match="neither a keras-ft"):
        keras_ft.load_checkpoint(str(tmp_path / "nothing"), make_model())
    with pytest.raises(keras_ft.CheckpointError, match="holds no checkpoint"):
        keras_ft.load_checkpoint(str(tmp_path), make_model())
    for kwargs, message in [
        ({"poll_seconds": 0}, "poll_seconds=0"),
        ({"timeout": -1}, "timeout=-1"),
    ]:
        with pytest.raises(ValueError, match=message):
            next(keras_ft.watch(str(tmp_path), **kwargs))
    # A directory that does not exist yet is waited for, up to the timeout.
    started = time.monotonic()
    assert list(keras_ft.watch(str(tmp_path / "later"), timeout=0.2)) == []
    assert time.monotonic() - started >= 0.2


@run_once_on("tensorflow", "two processes and TensorBoard")
def test_the_evaluate_while_training_example(tmp_path):
    import tensorflow as tf

    example = os.path.join(
        os.path.dirname(os.path.dirname(__file__)),
        "examples", "evaluate_while_training.py",
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, example, "--epochs", "2", "--dir", str(tmp_path)],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    evaluated = [
        line for line in result.stdout.splitlines() if "validation loss" in line
    ]
    assert len(evaluated) >= 2
    steps = [int(line.split()[2]) for line in evaluated]
    assert steps == sorted(steps) and steps[-1] == 2 * 4096 // 64
    tags = set()
    for path in glob.glob(str(tmp_path / "logs" / "validation" / "events.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(v.tag for v in event.summary.value)
    assert "evaluation_loss_vs_iterations" in tags


def test_an_evaluator_on_a_bucket_keeps_no_download(tmp_path, data, monkeypatch):
    """watch() and load_checkpoint() over 20 commits of a bucket: each load
    removes its download once the model holds the values, so the local disk
    never holds more than the checkpoint being loaded."""
    import tempfile

    local_tmp = tmp_path / "tmp"
    local_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(local_tmp))
    backup = f"memory://keras-ft-watch-{os.getpid()}-{time.monotonic_ns()}"
    x, y = data
    model = make_model()
    state = keras_ft.WorkerTrainingState(model, backup, keep=20)
    saved = []
    for epoch in range(20):
        model.train_on_batch(x[:16], y[:16])
        state.back_up(epoch)
        saved.append(weights_of(model))
    evaluator = make_model()
    loaded = []
    for checkpoint in keras_ft.watch(backup, timeout=0):
        keras_ft.load_checkpoint(checkpoint, evaluator)
        loaded.append(checkpoint.epoch)
        for got, want in zip(
            weights_of(evaluator), saved[checkpoint.epoch - 1], strict=True
        ):
            np.testing.assert_array_equal(got, want)
        # Nothing of keras-ft's is left in the temporary directory: no
        # download, no upload staging.
        left = glob.glob(str(local_tmp / "keras-ft-*"))
        assert left == [], left
    assert loaded == list(range(1, 21))
    state.delete_backup()
