"""BackupAndRestore in real `fit()` runs, in this process and in killed ones."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from conftest import (
    STEPS_PER_EPOCH,
    backup_deleted,
    checkpoint_entries,
    iterations,
    make_data,
    make_model,
    read_events,
    run_once_on,
    run_training,
    start_training,
    subprocess_env,
    tree_digest,
    weights_of,
)

import keras_ft
from keras_ft import threads
from keras_ft.checkpoint.store import CheckpointStore


class InterruptAtEpochEnd(keras.callbacks.Callback):
    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epoch:
            raise RuntimeError("Interrupting!")


class StepsAtFirstBatch(keras.callbacks.Callback):
    """Records the optimizer step seen before the first training step."""

    def on_train_begin(self, logs=None):
        self.first_epoch = None
        self.step_at_first_batch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_epoch is None:
            self.first_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.step_at_first_batch is None:
            self.step_at_first_batch = iterations(self.model)


def chief_checkpoints(backup_dir):
    return [
        c.name for c in CheckpointStore(os.path.join(backup_dir, "chief")).checkpoints()
    ]


def interrupted_fit(backup_dir, data, at_epoch=5, epochs=10, **kwargs):
    model = make_model()
    with pytest.raises(RuntimeError, match="Interrupting"):
        model.fit(
            *data,
            epochs=epochs,
            batch_size=16,
            verbose=0,
            callbacks=[
                keras_ft.BackupAndRestore(backup_dir, **kwargs),
                InterruptAtEpochEnd(at_epoch),
            ],
        )
    # fit() raised, so nothing waited for the last background write.
    keras_ft.wait_for_backups()
    return model


# The TensorFlow migration guide's scenario.


@pytest.mark.compat_core
def test_interrupted_fit_resumes_at_next_epoch_in_same_process(backup_dir, data):
    interrupted = interrupted_fit(backup_dir, data)
    assert iterations(interrupted) == 5 * STEPS_PER_EPOCH
    model = make_model()
    probe = StepsAtFirstBatch()
    history = model.fit(
        *data,
        epochs=10,
        batch_size=16,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), probe],
    )
    # History covers every epoch, before and after the interruption.
    assert len(history.history["loss"]) == 10
    assert history.epoch == list(range(10))
    assert probe.first_epoch == 5
    assert probe.step_at_first_batch == 5 * STEPS_PER_EPOCH
    assert iterations(model) == 10 * STEPS_PER_EPOCH
    assert backup_deleted(backup_dir)


# Not in compat_core: test_exact_resume's SIGKILL resumes in a new process there.
def test_interrupted_process_resumes_in_a_new_process(backup_dir):
    code, events, stderr = run_training(backup_dir, "--raise-at-epoch-end", "5")
    assert code != 0 and "Interrupting at the end of epoch 5" in stderr
    assert [e["epoch"] for e in events if e["kind"] == "epoch_end"] == list(range(5))

    code, events, stderr = run_training(backup_dir)
    assert code == 0, stderr
    by_kind = {e["kind"]: e for e in events}
    assert by_kind["first_epoch"] == {
        "kind": "first_epoch",
        "epoch": 5,
        "step": 5 * STEPS_PER_EPOCH,
    }
    assert [e["epoch"] for e in events if e["kind"] == "epoch_end"] == list(
        range(5, 10)
    )
    assert by_kind["done"]["step"] == 10 * STEPS_PER_EPOCH
    assert by_kind["done"]["history_epochs"] == list(range(10))
    assert backup_deleted(backup_dir)


def test_sigkill_at_random_moments_resumes_every_time(backup_dir):
    """Six real SIGKILLs while saving every batch; every restart resumes.

    Most kills land after the first batch (so mostly inside or between
    saves); every third lands during restore and the first step's tracing.
    (benchmarks/kill_fuzz.py, also in the suite, kills fresh runs.)
    """
    rng = random.Random(20261121)
    restored_steps = []
    kills_after_first_commit = 0
    for attempt in range(6):
        process = start_training(
            backup_dir,
            "--epochs", "100000",
            "--save-freq", "1",
            "--keep-backup",
        )  # fmt: skip
        begin = read_events(process, until="begin")
        assert begin, process.stderr.read()
        restored_steps.append(begin[-1]["step"])
        if attempt % 3 != 2:
            assert read_events(process, until="first_batch_end")
        time.sleep(rng.uniform(0.0, 0.5))
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
        kills_after_first_commit += bool(chief_checkpoints(backup_dir))
    # Progress is never lost: each restart starts at or after the previous one.
    assert restored_steps == sorted(restored_steps)
    assert restored_steps[-1] > 0 and kills_after_first_commit >= 4
    # The last backup loads and training runs on to the end.
    metadata = CheckpointStore(os.path.join(backup_dir, "chief")).latest_good()[1]
    epochs = metadata["epochs_completed"] + 2
    code, events, stderr = run_training(backup_dir, "--epochs", str(epochs))
    assert code == 0, stderr
    first = next(e for e in events if e["kind"] == "first_epoch")
    assert first["step"] == metadata["step"] >= restored_steps[-1]
    assert first["epoch"] == metadata["epochs_completed"]


# Damaged backups.


def damage(path, how):
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 3)
    elif how == "flipped":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x55]))
    else:
        os.remove(path)


@pytest.mark.compat_core
@pytest.mark.parametrize("how", ["truncated", "flipped", "deleted"])
def test_damaged_newest_backup_falls_back_to_the_previous(backup_dir, data, how):
    interrupted_fit(backup_dir, data, at_epoch=3)
    newest = os.path.join(backup_dir, "chief", "ckpt-00000003")
    damage(os.path.join(newest, "model.weights.h5"), how)
    model = make_model()
    probe = StepsAtFirstBatch()
    with pytest.warns(UserWarning, match="ckpt-00000003 is damaged"):
        model.fit(
            *data,
            epochs=4,
            batch_size=16,
            verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir), probe],
        )
    assert probe.first_epoch == 2
    assert probe.step_at_first_batch == 2 * STEPS_PER_EPOCH
    assert iterations(model) == 4 * STEPS_PER_EPOCH


def test_no_good_backup_raises_before_training_and_deletes_nothing(backup_dir, data):
    interrupted_fit(backup_dir, data, at_epoch=2)
    for name in chief_checkpoints(backup_dir):
        damage(os.path.join(backup_dir, "chief", name, "model.weights.h5"), "flipped")
    before = tree_digest(backup_dir)
    model = make_model()
    with (
        pytest.warns(UserWarning),
        pytest.raises(keras_ft.NoGoodCheckpointError, match="nothing was deleted"),
    ):
        model.fit(
            *data,
            epochs=3,
            verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir)],
        )
    assert tree_digest(backup_dir) == before


# Bad input: a clear error, before any step, and the existing backup untouched.


@pytest.fixture
def existing_backup(backup_dir, data):
    interrupted_fit(backup_dir, data, at_epoch=2)
    return backup_dir, tree_digest(backup_dir)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"save_freq": 0}, "`save_freq`.*Received: save_freq=0"),
        ({"save_freq": -3}, "`save_freq`.*Received: save_freq=-3"),
        ({"save_freq": True}, "`save_freq`.*Received: save_freq=True"),
        ({"save_freq": "batch"}, "`save_freq`.*Received: save_freq='batch'"),
        ({"save_freq": 2.0}, "`save_freq`.*Received: save_freq=2.0"),
        ({"keep": 0}, "`keep`.*Received: keep=0"),
        ({"save_every_seconds": -1}, "`save_every_seconds`.*=-1"),
    ],
)
def test_bad_arguments_are_rejected_by_name(existing_backup, kwargs, message):
    backup_dir, before = existing_backup
    with pytest.raises(ValueError, match=message):
        keras_ft.BackupAndRestore(backup_dir, **kwargs)
    assert tree_digest(backup_dir) == before


@pytest.mark.parametrize("bad", ["", None])
def test_empty_backup_dir_is_rejected_with_keras_wording_first(bad):
    # Keras' own sentence first: code matching Keras' message keeps working.
    with pytest.raises(ValueError, match="^Empty `backup_dir` argument passed") as e:
        keras_ft.BackupAndRestore(bad)
    assert f"Received: backup_dir={bad!r}" in str(e.value)


def test_backup_dir_that_is_a_file_is_rejected(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("precious")
    with pytest.raises(ValueError, match="`backup_dir`: it is an existing file"):
        keras_ft.BackupAndRestore(str(path))
    assert path.read_text() == "precious"


def test_unwritable_backup_dir_fails_before_any_step(unwritable_dir, data):
    model = make_model()
    callback = keras_ft.BackupAndRestore(os.path.join(unwritable_dir, "backup"))
    with pytest.raises(ValueError, match="`backup_dir`: cannot write"):
        model.fit(*data, epochs=1, verbose=0, callbacks=[callback])
    assert iterations(model) == 0


def test_backup_of_another_architecture_is_refused_untouched(existing_backup, data):
    backup_dir, before = existing_backup
    other = make_model(units=12)
    callback = keras_ft.BackupAndRestore(backup_dir)
    with pytest.raises(ValueError, match=r"kernel.*\(4, 12\).*\(4, 8\)"):
        other.fit(*data, epochs=3, verbose=0, callbacks=[callback])
    assert iterations(other) == 0
    assert tree_digest(backup_dir) == before


# Lifecycle.


def test_unbuilt_model_is_restored_before_the_first_step(backup_dir, data):
    interrupted_fit(backup_dir, data, at_epoch=2)
    model = make_model(built=False)
    probe = StepsAtFirstBatch()
    model.fit(
        *data,
        epochs=3,
        batch_size=16,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), probe],
    )
    assert probe.first_epoch == 2
    assert probe.step_at_first_batch == 2 * STEPS_PER_EPOCH
    assert iterations(model) == 3 * STEPS_PER_EPOCH


def test_callback_and_model_can_be_fitted_again_after_completion(backup_dir, data):
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir)
    probe = StepsAtFirstBatch()
    model.fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=[callback, probe])
    assert backup_deleted(backup_dir)
    model.fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=[callback, probe])
    assert probe.first_epoch == 0  # No stale resume epoch.
    assert iterations(model) == 4 * STEPS_PER_EPOCH
    # The same model fitted without the callback is not affected either.
    history = model.fit(*data, epochs=1, batch_size=16, verbose=0, callbacks=[probe])
    assert probe.first_epoch == 0 and len(history.history["loss"]) == 1


def test_a_finished_fit_leaves_nothing_beside_the_backup_once_removed(backup_dir, data):
    """fit()'s end moves the checkpoints out of `backup_dir` (gone when it
    returns), and nothing of them stays beside it once their removal is
    done (whether fit() waits for it: `test_store`)."""
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir, save_freq=2)
    model.fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
    assert backup_deleted(backup_dir)
    threads.wait_for_discards()
    parent = os.path.dirname(os.path.abspath(backup_dir))
    assert [n for n in os.listdir(parent) if "keras-ft-deleted" in n] == []


def test_fits_of_one_model_share_one_copy_buffer(backup_dir, data):
    """The buffer saves copy into is made once per training: the next fit()
    of the model with the same callback reuses it; none is made where only
    a preemption would save."""
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir, save_freq=2)
    model.fit(*data, epochs=1, batch_size=16, verbose=0, callbacks=[callback])
    buffer = callback._copy_buffer
    assert buffer is not None and buffer.size > 0
    model.fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
    assert callback._copy_buffer is buffer
    idle = keras_ft.BackupAndRestore(backup_dir, save_freq=False)
    model.fit(*data, epochs=1, batch_size=16, verbose=0, callbacks=[idle])
    assert idle._copy_buffer is None


def test_callback_instance_is_reusable_after_an_interruption(backup_dir, data):
    callback = keras_ft.BackupAndRestore(backup_dir)
    model = make_model()
    with pytest.raises(RuntimeError):
        model.fit(
            *data, epochs=4, verbose=0, callbacks=[callback, InterruptAtEpochEnd(2)]
        )
    probe = StepsAtFirstBatch()
    model.fit(*data, epochs=4, verbose=0, callbacks=[callback, probe])
    assert probe.first_epoch == 2


def test_terminate_on_nan_keeps_the_backup_and_never_saves_nan(backup_dir, data):
    x, y = data
    interrupted_fit(backup_dir, data, at_epoch=2)
    y_bad = y.copy()
    y_bad[20:] = np.nan  # Unshuffled, batch 0 is finite and batch 1 is NaN.
    model = make_model()
    with pytest.warns(UserWarning, match="not backing up a diverged model"):
        model.fit(
            x,
            y_bad,
            epochs=5,
            batch_size=16,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras_ft.BackupAndRestore(backup_dir, save_freq=1),
                keras.callbacks.TerminateOnNaN(),
            ],
        )
    assert model.stop_training
    # Kept (Keras' own deletes it here), holding only finite weights: the
    # save after batch 0 of epoch 3, and nothing after the loss went NaN.
    assert chief_checkpoints(backup_dir) == ["ckpt-00000002", "ckpt-00000003"]
    restored = make_model()
    resume = keras_ft.WorkerTrainingState(restored, backup_dir).restore()
    assert (resume.epoch, resume.batch) == (2, 1)
    assert all(np.all(np.isfinite(w)) for w in weights_of(restored))


def test_early_stopping_keeps_the_backup(backup_dir, data):
    model = make_model()
    model.fit(
        *data,
        epochs=50,
        verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(backup_dir),
            keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9),
        ],
    )
    assert chief_checkpoints(backup_dir)


def test_delete_checkpoint_false_keeps_the_backup(backup_dir, data):
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(*data, epochs=3, verbose=0, callbacks=[callback])
    assert chief_checkpoints(backup_dir) == ["ckpt-00000002", "ckpt-00000003"]


def test_completion_deletes_only_its_own_files(backup_dir, data):
    os.makedirs(backup_dir)
    with open(os.path.join(backup_dir, "notes.txt"), "w") as f:
        f.write("mine")
    model = make_model()
    model.fit(
        *data, epochs=2, verbose=0, callbacks=[keras_ft.BackupAndRestore(backup_dir)]
    )
    # The checkpoints went; the user's notes stay.
    assert sorted(os.listdir(backup_dir)) == ["notes.txt"]


@pytest.mark.parametrize(
    "kwargs, kept",
    [({"keep": 3}, 3), ({"keep": 1}, 1), ({"keep": 1, "double_checkpoint": True}, 2)],
)
def test_keep_sets_how_many_backups_remain(backup_dir, data, kwargs, kept):
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False, **kwargs)
    model.fit(*data, epochs=5, verbose=0, callbacks=[callback])
    assert len(chief_checkpoints(backup_dir)) == kept


def test_save_freq_in_batches(backup_dir, data):
    model = make_model()
    callback = keras_ft.BackupAndRestore(
        backup_dir, save_freq=3, delete_checkpoint=False, keep=100
    )
    model.fit(*data, epochs=3, batch_size=16, verbose=0, callbacks=[callback])
    # 12 steps, a save every 3: after steps 3, 6, 9 and 12.
    assert len(chief_checkpoints(backup_dir)) == 4
    resume = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    assert (resume.epoch, resume.batch, resume.step) == (2, 4, 12)


def test_save_every_seconds_saves_on_a_clock(backup_dir, data):
    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.05)

    model = make_model()
    callback = keras_ft.BackupAndRestore(
        backup_dir, save_every_seconds=0.12, delete_checkpoint=False, keep=100
    )
    model.fit(*data, epochs=2, batch_size=16, verbose=0, callbacks=[callback, Slow()])
    count = len(chief_checkpoints(backup_dir))
    # 8 batches of >= 50 ms: at least 2 clock saves, plus 2 epoch-end saves.
    assert 4 <= count <= 2 + 8


def test_restore_prints_one_line_when_verbose(backup_dir, data, capsys):
    interrupted_fit(backup_dir, data, at_epoch=2)
    capsys.readouterr()
    model = make_model()
    model.fit(
        *data, epochs=3, verbose=0, callbacks=[keras_ft.BackupAndRestore(backup_dir)]
    )
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if "BackupAndRestore" in line
    ]
    assert len(lines) == 1
    assert "ckpt-00000002" in lines[0] and "resuming at epoch 3/3" in lines[0]
    assert "optimizer step 8" in lines[0] and "saved 20" in lines[0]

    interrupted_fit(backup_dir, data, at_epoch=2)
    capsys.readouterr()
    callback = keras_ft.BackupAndRestore(backup_dir, verbose=0)
    make_model().fit(*data, epochs=3, verbose=0, callbacks=[callback])
    assert "BackupAndRestore" not in capsys.readouterr().out


# Exact resume, in this process (the SIGKILL proofs are in test_exact_resume.py).


class CountingCallback(keras.callbacks.Callback):
    """A user callback taking part through get_state/set_state."""

    def __init__(self):
        super().__init__()
        self.epochs_seen = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs_seen += 1

    def get_state(self):
        return {"epochs_seen": self.epochs_seen}

    def set_state(self, state):
        self.epochs_seen = state["epochs_seen"]


class InterruptAtEpochBegin(keras.callbacks.Callback):
    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("Interrupting!")


def test_user_callback_state_survives_a_restart(backup_dir, data):
    counter = CountingCallback()
    model = make_model()
    with pytest.raises(RuntimeError):
        model.fit(
            *data,
            epochs=5,
            verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir), counter,
                       InterruptAtEpochBegin(3)],
        )  # fmt: skip
    assert counter.epochs_seen == 3
    resumed = CountingCallback()
    make_model().fit(
        *data,
        epochs=5,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), resumed],
    )
    assert resumed.epochs_seen == 5


def test_tensorboard_step_axis_continues(backup_dir, data, tmp_path):
    def steps_seen_by_tensorboard(callbacks, epochs=3):
        board = keras.callbacks.TensorBoard(str(tmp_path / "logs"), update_freq=1)
        seen = []

        class Spy(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                seen.append(board._global_train_batch)

        model = make_model()
        model.fit(
            *data, epochs=epochs, batch_size=16, verbose=0,
            callbacks=[*callbacks, board, Spy()],
        )  # fmt: skip
        return seen

    uninterrupted = steps_seen_by_tensorboard([])
    interrupted_fit(backup_dir, data, at_epoch=2)
    resumed = steps_seen_by_tensorboard([keras_ft.BackupAndRestore(backup_dir)])
    assert resumed == uninterrupted[2 * STEPS_PER_EPOCH :]
    assert resumed[0] > STEPS_PER_EPOCH  # Not starting again at 0.


# Reliability: preemption, a second writer, disk full and lost permissions.


@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGTERM,
        # Another signal takes the same path: one backend is enough.
        pytest.param(signal.SIGINT, marks=run_once_on("torch", "the same path")),
    ],
)
def test_preemption_signal_backs_up_the_exact_step_and_exits(backup_dir, signum):
    process = start_training(
        backup_dir, "--epochs", "1000", "--seconds-per-batch", "0.05"
    )  # Saves only at epoch ends, so any mid-epoch backup is the signal's.
    assert read_events(process, until="first_batch_end")
    time.sleep(0.12)
    process.send_signal(signum)
    events = read_events(process)
    stdout_rest, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum  # SystemExit, as a shell would report.
    assert "Traceback" not in stderr
    metadata = CheckpointStore(os.path.join(backup_dir, "chief")).latest_good()[1]
    assert metadata["batches_completed"] > 0  # Mid-epoch: saved by the signal.

    code, events, stderr = run_training(backup_dir, "--epochs", "3")
    assert code == 0, stderr
    first = next(e for e in events if e["kind"] == "first_epoch")
    assert first["step"] == metadata["step"]
    assert first["epoch"] == metadata["epochs_completed"]
    done = next(e for e in events if e["kind"] == "done")
    assert done["step"] == 3 * STEPS_PER_EPOCH


@run_once_on("torch", "the message; the SIGTERM path per backend is above")
def test_preemption_message_is_printed(backup_dir):
    process = start_training(
        backup_dir, "--epochs", "1000", "--seconds-per-batch", "0.05"
    )
    assert read_events(process, until="first_batch_end")
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    assert "BackupAndRestore: received SIGTERM; backed up epoch 1, batch" in stdout
    assert "run the same script again to resume" in stdout


@run_once_on("torch", "a timer in the signal handler's thread")
def test_no_batch_end_within_the_grace_period_exits_anyway(backup_dir):
    process = start_training(
        backup_dir, "--epochs", "1000", "--seconds-per-batch", "600",
        "--grace-period", "0.5",
    )  # fmt: skip
    assert read_events(process, until="first_batch_end")
    process.send_signal(signal.SIGTERM)
    # The batch in progress lasts 10 minutes; exiting within the timeout
    # means the process did not wait for it.
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    assert "no batch ended within the grace period" in stdout


class SendSignalAt(keras.callbacks.Callback):
    def __init__(self, batch: int, signum: signal.Signals):
        super().__init__()
        self.batch, self.signum = batch, signum

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            os.kill(os.getpid(), self.signum)


def test_preemption_chains_to_the_users_handler_and_restores_it(backup_dir, data):
    calls = []

    def user_handler(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGTERM, user_handler)
    try:
        callback = keras_ft.BackupAndRestore(backup_dir, exit_on_preemption=False)
        model = make_model()
        model.fit(
            *data,
            epochs=5,
            batch_size=16,
            verbose=0,
            callbacks=[callback, SendSignalAt(2, signal.SIGTERM)],
        )
        assert calls == [signal.SIGTERM]
        assert callback.preempted_by == "SIGTERM"
        assert iterations(model) == 3  # Stopped after the batch that was running.
        assert signal.getsignal(signal.SIGTERM) is user_handler
        resume = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
        assert (resume.epoch, resume.batch, resume.step) == (0, 3, 3)
    finally:
        signal.signal(signal.SIGTERM, old)


class SignalAtBatchBegin(SendSignalAt):
    """Async-safe: with keras-ft alone beside it, Keras calls the batch ends
    on a thread of its own (JAX, PyTorch)."""

    async_safe = True

    def on_train_begin(self, logs=None):
        self.thread, self.ends_off_thread = threading.get_ident(), set()

    def on_train_batch_end(self, batch, logs=None):
        self.ends_off_thread.add(threading.get_ident() != self.thread)


def test_preemption_stops_with_the_model_as_backed_up(backup_dir, data):
    # Seen at batch 4's begin on JAX and PyTorch, before the step Keras then
    # runs: that step must change nothing.
    callback = keras_ft.BackupAndRestore(
        backup_dir, exit_on_preemption=False, delete_checkpoint=False
    )
    model = make_model()
    signals = SignalAtBatchBegin(2, signal.SIGTERM)
    model.fit(*data, epochs=5, batch_size=16, verbose=0, callbacks=[callback, signals])
    assert signals.ends_off_thread == {keras.backend.backend() != "tensorflow"}
    assert callback.preempted_by == "SIGTERM"
    assert iterations(model) == 3
    restored = make_model()
    resume = keras_ft.WorkerTrainingState(restored, backup_dir).restore()
    assert (resume.epoch, resume.batch, resume.step) == (0, 3, 3)
    for ours, backed_up in zip(weights_of(model), weights_of(restored), strict=True):
        np.testing.assert_array_equal(ours, backed_up)


def test_ctrl_c_after_a_fit_that_raised_is_a_keyboard_interrupt(backup_dir, data):
    class Fails(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("a bug in the training loop")

    # Python's own handler, even where the suite runs with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    callback = keras_ft.BackupAndRestore(backup_dir)
    try:
        with pytest.raises(RuntimeError):
            make_model().fit(*data, epochs=2, callbacks=[callback, Fails()], verbose=0)
        # fit() raised, so no train end put the handlers back; they must not
        # take this Ctrl-C for a preemption of a training that is over.
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert callback.preempted_by is None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # The same callback trains again, and handles a preemption again.
        model = make_model()
        sigterm_at_batch_2 = SendSignalAt(2, signal.SIGTERM)
        callback.exit_on_preemption = False
        model.fit(
            *data, epochs=2, batch_size=16, verbose=0,
            callbacks=[callback, sigterm_at_batch_2],
        )  # fmt: skip
        assert callback.preempted_by == "SIGTERM" and iterations(model) == 3
    finally:
        callback._preemption.watcher.done()  # Whatever happened, no delayed exit.


@run_once_on("torch", "a lock on the directory; the backend does not matter")
def test_second_trainer_on_the_same_directory_is_refused(backup_dir, data):
    process = start_training(
        backup_dir, "--epochs", "1000", "--seconds-per-batch", "0.05"
    )
    try:
        assert read_events(process, until="first_batch_end")
        model = make_model()
        with pytest.raises(keras_ft.DirectoryInUseError, match=f"pid {process.pid}"):
            model.fit(
                *data,
                epochs=1,
                verbose=0,
                callbacks=[keras_ft.BackupAndRestore(backup_dir)],
            )
        assert iterations(model) == 0
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    # The dead process's lock holds nothing: the same directory now resumes.
    model = make_model()
    probe = StepsAtFirstBatch()
    model.fit(
        *data,
        epochs=2,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), probe],
    )
    assert probe.first_epoch is not None


def test_disk_full_raises_and_keeps_the_previous_backup(small_filesystem, data):
    from conftest import fill_filesystem

    backup_dir = os.path.join(small_filesystem, "backup")
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(*data, epochs=2, verbose=0, callbacks=[callback])
    before = tree_digest(os.path.join(backup_dir, "chief"))
    fill_filesystem(small_filesystem)
    with pytest.raises(keras_ft.CheckpointWriteError) as info:
        model.fit(*data, epochs=4, verbose=0, callbacks=[callback])
    assert info.value.errno == 28
    assert "ckpt-00000002 is intact" in str(info.value)
    assert "on_save_error='warn'" in str(info.value)
    assert tree_digest(os.path.join(backup_dir, "chief")) == before
    assert not [
        n
        for n in os.listdir(os.path.join(backup_dir, "chief"))
        if n.startswith(".staging")
    ]
    resume = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    assert resume.epoch == 2


def test_disk_full_with_warn_keeps_training_and_retries(small_filesystem, data):
    from conftest import fill_filesystem

    backup_dir = os.path.join(small_filesystem, "backup")
    model = make_model()
    first = keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(*data, epochs=1, batch_size=16, verbose=0, callbacks=[first])
    filler = fill_filesystem(small_filesystem)

    class FreeSpaceAfterEpoch3(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 2:
                os.remove(filler)

    callback = keras_ft.BackupAndRestore(
        backup_dir, delete_checkpoint=False, on_save_error="warn"
    )
    with pytest.warns(UserWarning, match="No space left on device"):
        model.fit(
            *data, epochs=5, batch_size=16, verbose=0,
            callbacks=[callback, FreeSpaceAfterEpoch3()],
        )  # fmt: skip
    assert iterations(model) == 5 * STEPS_PER_EPOCH
    resume = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    assert resume.epoch == 5  # The saves after space came back went through.


class RemountReadOnly(keras.callbacks.Callback):
    def __init__(self, filesystem: str, at_epoch: int):
        super().__init__()
        self.filesystem, self.at_epoch = filesystem, at_epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at_epoch:
            # A file open for writing (a backup in flight) blocks remount.
            keras_ft.wait_for_backups()
            subprocess.run(["mount", "-o", "remount,ro", self.filesystem], check=True)


@pytest.mark.parametrize("at_epoch", [1, 2])
def test_directory_turned_read_only_mid_training_raises_cleanly(
    small_filesystem, data, at_epoch
):
    # At epoch 2 of 3, the failing save is the last one, which train end
    # calls off as the backup is about to go: its error must still come out.
    backup_dir = os.path.join(small_filesystem, "backup")
    model = make_model()
    callbacks = [
        keras_ft.BackupAndRestore(backup_dir),
        RemountReadOnly(small_filesystem, at_epoch),
    ]
    intact = f"ckpt-0000000{at_epoch} is intact"
    with pytest.raises(keras_ft.CheckpointWriteError, match=intact):
        model.fit(*data, epochs=3, verbose=0, callbacks=callbacks)
    resume = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    assert resume.epoch == at_epoch


def test_auto_save_freq_saves_within_the_budget_and_says_how_often(
    backup_dir, data, capsys
):
    class SlowStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.02)

    x, y = data
    x, y = np.concatenate([x] * 8), np.concatenate([y] * 8)  # 32 steps/epoch.
    callback = keras_ft.BackupAndRestore(
        backup_dir, save_freq="auto", overhead_budget=0.5, delete_checkpoint=False,
        keep=1000,
    )  # fmt: skip
    model = make_model()
    # The interval is planned once the first save's write is over: ~1.7 s of
    # steps after it, for a loaded machine's slow fsync.
    model.fit(
        x, y, epochs=3, batch_size=16, verbose=0, callbacks=[SlowStep(), callback]
    )
    out = capsys.readouterr().out
    assert "BackupAndRestore: saving every" in out and "budget 50.0%" in out
    saves = len(chief_checkpoints(backup_dir))
    assert 2 <= saves < 96  # Saved, but not after every one of the 96 steps.


@pytest.mark.parametrize("bad", [0, 1.5, "x"])
def test_bad_overhead_budget_is_rejected(bad, backup_dir):
    with pytest.raises(ValueError, match="`overhead_budget`"):
        keras_ft.BackupAndRestore(backup_dir, save_freq="auto", overhead_budget=bad)


# Drop-in fidelity: where Keras' own callback does right, or wrong.


def fit_probed(backup_dir, data, epochs=3, extra_callbacks=(), **kwargs):
    probe = StepsAtFirstBatch()
    model = make_model()
    model.fit(
        *data,
        epochs=epochs,
        batch_size=16,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, **kwargs), probe,
                   *extra_callbacks],
    )  # fmt: skip
    return model, probe


def restored_extra(backup_dir):
    resume = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    return resume, resume.extra


@pytest.mark.compat_core
@pytest.mark.parametrize("async_save", [True, False])
def test_exception_in_a_later_callback_keeps_the_epochs_backup(
    backup_dir, data, async_save
):
    # The TensorFlow fault-tolerance guide's failure, before a stateful
    # callback: Keras calls no other callback once one raises.
    model = make_model()
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=5)
    with pytest.raises(RuntimeError, match="Interrupting"):
        model.fit(
            *data,
            epochs=5,
            batch_size=16,
            verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir, async_save=async_save),
                       InterruptAtEpochEnd(1), stopper],
        )  # fmt: skip
    keras_ft.wait_for_backups()
    resume, extra = restored_extra(backup_dir)
    assert (resume.epoch, resume.batch, resume.step) == (1, 0, STEPS_PER_EPOCH)
    assert extra["callbacks_pending"] == ["EarlyStopping:0"]
    with pytest.warns(UserWarning, match="before the on_epoch_end of EarlyStopping:0"):
        _, probe = fit_probed(backup_dir, data, epochs=3)
    assert probe.first_epoch == 1
    assert probe.step_at_first_batch == STEPS_PER_EPOCH


SCRIPT_KILLED_BETWEEN_EPOCH_END_AND_THE_TAIL = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import keras
from conftest import make_data, make_model
import keras_ft

class KillAfterTheBackup(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            keras_ft.wait_for_backups()  # What an async save reaches in time.
            os.kill(os.getpid(), signal.SIGKILL)

make_model().fit(
    *make_data(), epochs=4, batch_size=16, verbose=0,
    callbacks=[keras_ft.BackupAndRestore({backup_dir!r}), KillAfterTheBackup(),
               keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1)],
)
"""


def test_sigkill_between_the_epoch_end_and_later_callbacks_keeps_the_epoch(
    backup_dir,
):
    script = SCRIPT_KILLED_BETWEEN_EPOCH_END_AND_THE_TAIL.format(
        tests=os.path.dirname(os.path.abspath(__file__)), backup_dir=backup_dir
    )
    process = subprocess.run(
        [sys.executable, "-c", script],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    resume, extra = restored_extra(backup_dir)
    assert (resume.epoch, resume.batch) == (2, 0)
    assert extra["callbacks_pending"] == ["ReduceLROnPlateau:0"]


class LearningRateAtTrainEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.learning_rate = float(
            keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
        )


@pytest.mark.parametrize("async_save", [True, False])
def test_later_callbacks_epoch_end_is_in_the_backup_that_replaces_the_first(
    backup_dir, data, async_save
):
    # ReduceLROnPlateau after the callback lowers the learning rate at every
    # epoch end (a loss that never improves by 1e9): the backup must hold
    # the lowered rate and the callback's counters, in one backup per epoch.
    reduce_lr = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9
    )
    counter = CountingCallback()
    learning_rate = LearningRateAtTrainEnd()
    model = make_model()
    model.fit(
        *data,
        epochs=3,
        batch_size=16,
        verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False,
                                             async_save=async_save),
                   reduce_lr, counter, learning_rate],
    )  # fmt: skip
    # keep=2 still means the last two epochs: the replaced first backups of
    # an epoch took no older backup's place.
    checkpoints = chief_checkpoints(backup_dir)
    assert len(checkpoints) == 2
    stores = CheckpointStore(os.path.join(backup_dir, "chief"))
    epochs = [stores.verify(c)["epochs_completed"] for c in stores.checkpoints()]
    assert epochs == [2, 3]
    restored = make_model()
    resume = keras_ft.WorkerTrainingState(restored, backup_dir).restore()
    assert "callbacks_pending" not in resume.extra
    assert resume.extra["callbacks"]["CountingCallback:0"] == {"epochs_seen": 3}
    assert resume.extra["callbacks"]["ReduceLROnPlateau:0"]["cooldown_counter"] == 0
    restored_rate = float(keras.ops.convert_to_numpy(restored.optimizer.learning_rate))
    assert restored_rate == learning_rate.learning_rate < 1e-2


def diverging_model_and_data():
    # The example of Keras' BackupAndRestore docstring: the loss goes to
    # inf, then NaN.
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(), loss="mse")
    return model, (np.arange(100).reshape(5, 20).astype("float32"), np.zeros(5))


def test_diverged_run_warns_at_every_skip_and_leaves_no_stale_backup(backup_dir):
    model, (x, y) = diverging_model_and_data()
    with pytest.warns(UserWarning) as warned:
        history = model.fit(
            x, y, epochs=6, batch_size=1, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir)],
        )  # fmt: skip
    diverged = [
        e for e, loss in enumerate(history.history["loss"]) if not np.isfinite(loss)
    ]
    assert len(diverged) >= 2 and 0 not in diverged
    messages = [str(w.message) for w in warned]
    skipped = [m for m in messages if "not backing up a diverged model" in m]
    assert skipped == [
        f"BackupAndRestore: the loss is {history.history['loss'][e]} at epoch "
        f"{e + 1}; not backing up a diverged model. The last good backup is kept."
        for e in diverged
    ]
    assert any("fit() ran every epoch" in m for m in messages), messages
    assert chief_checkpoints(backup_dir) == []
    # A new run on the directory starts afresh, not from the old state.
    model, (x, y) = diverging_model_and_data()
    probe = StepsAtFirstBatch()
    model.fit(
        x, y, epochs=1, batch_size=1, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), probe],
    )  # fmt: skip
    assert (probe.first_epoch, probe.step_at_first_batch) == (0, 0)


class PoisonAtEpochEnd(keras.callbacks.Callback):
    """Puts a NaN into a variable at an epoch end, the loss staying finite."""

    def __init__(self, epoch: int, variable: str):
        super().__init__()
        self.epoch, self.variable = epoch, variable

    def on_epoch_end(self, epoch, logs=None):
        if epoch != self.epoch:
            return
        if self.variable == "kernel":
            target = self.model.layers[0].kernel
        else:  # The first moment of Adam, an optimizer variable.
            target = self.model.optimizer.variables[2]
        value = keras.ops.convert_to_numpy(target).copy()
        value.reshape(-1)[1] = np.nan
        target.assign(value)


@pytest.mark.parametrize("variable", ["kernel", "optimizer"])
@pytest.mark.parametrize("async_save", [True, False])
def test_non_finite_weights_with_a_finite_loss_are_never_backed_up(
    backup_dir, data, variable, async_save
):
    model = make_model()
    with pytest.warns(UserWarning, match="hold NaN or infinity at epoch 2"):
        model.fit(
            *data,
            epochs=2,
            batch_size=16,
            verbose=0,
            callbacks=[PoisonAtEpochEnd(1, variable),
                       keras_ft.BackupAndRestore(backup_dir, keep=5,
                                                 async_save=async_save,
                                                 delete_checkpoint=False)],
        )  # fmt: skip
    keras_ft.wait_for_backups()
    assert len(chief_checkpoints(backup_dir)) == 1
    restored = make_model()
    resume = keras_ft.WorkerTrainingState(restored, backup_dir).restore()
    assert resume.epoch == 1
    assert all(np.all(np.isfinite(w)) for w in weights_of(restored))
    optimizer_values = [
        keras.ops.convert_to_numpy(v) for v in restored.optimizer.variables
    ]
    assert all(np.all(np.isfinite(v)) for v in optimizer_values)


class Tally(keras.layers.Layer):
    """Passes its input through; holds a variable the loss does not use."""

    def build(self, input_shape):
        self.count = self.add_weight(shape=(3,), initializer="zeros", trainable=False)

    def call(self, inputs):
        return inputs


class PoisonBetweenBatches(keras.callbacks.Callback):
    """Puts an infinity into `Tally`'s variable at one batch end and takes it
    out at a later one: the loss stays finite throughout."""

    def __init__(self, poison_at: int, heal_at: int):
        super().__init__()
        self.poison_at, self.heal_at = poison_at, heal_at

    def on_train_batch_end(self, batch, logs=None):
        count = self.model.layers[1].count
        if batch == self.poison_at:
            count.assign(np.array([0.0, np.inf, 0.0], "float32"))
        elif batch == self.heal_at:
            count.assign(np.zeros(3, "float32"))


def test_a_background_check_refuses_non_finite_saves_and_later_ones_go_on(
    backup_dir, data
):
    # In the background, the NaN/infinity check runs after the copy (training
    # waits for the copy alone) and the writer refuses the save before its
    # commit; the warning still names the save, and the next saves go on.
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), Tally(), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    with pytest.warns(UserWarning) as record:
        model.fit(
            *data,
            epochs=1,
            batch_size=16,
            verbose=0,
            callbacks=[PoisonBetweenBatches(poison_at=1, heal_at=3),
                       keras_ft.BackupAndRestore(backup_dir, save_freq=1, keep=100,
                                                 delete_checkpoint=False)],
        )  # fmt: skip
    keras_ft.wait_for_backups()
    refused = sorted(
        str(w.message).split(" at ")[1].split(";")[0]
        for w in record
        if "hold NaN or infinity" in str(w.message)
    )
    assert refused == ["epoch 1, batch 2", "epoch 1, batch 3"]
    saved = set()
    for checkpoint in chief_checkpoints(backup_dir):
        path = os.path.join(backup_dir, "chief", checkpoint, "metadata.json")
        with open(path) as f:
            metadata = json.load(f)
        saved.add((metadata["epochs_completed"], metadata["batches_completed"]))
    assert {(0, 2), (0, 3)}.isdisjoint(saved)
    assert {(0, 1), (0, 4)} <= saved
    restored = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), Tally(), keras.layers.Dense(1)]
    )
    restored.compile(keras.optimizers.Adam(1e-2), loss="mse")
    keras_ft.WorkerTrainingState(restored, backup_dir).restore()
    assert all(np.all(np.isfinite(w)) for w in weights_of(restored))


def test_save_freq_false_saves_only_on_preemption(backup_dir, data):
    class SignalAtSecondBatchOfSecondEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 1):
                os.kill(os.getpid(), signal.SIGTERM)

    callback = keras_ft.BackupAndRestore(
        backup_dir, save_freq=False, exit_on_preemption=False
    )
    model = make_model()

    class StopAtSecondBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = batch == 1

    # Stopped mid-epoch by another callback: no scheduled save, not even this.
    stop = StopAtSecondBatch()
    model.fit(*data, epochs=2, verbose=0, batch_size=16, callbacks=[callback, stop])
    assert chief_checkpoints(backup_dir) == []
    signal_at = SignalAtSecondBatchOfSecondEpoch()
    make_model().fit(
        *data, epochs=3, verbose=0, batch_size=16, callbacks=[callback, signal_at]
    )
    assert callback.preempted_by == "SIGTERM"
    resume, _ = restored_extra(backup_dir)
    # The signal came after this callback's batch end: saved at the next one.
    assert (resume.epoch, resume.batch) == (1, 3)


def test_restore_line_after_the_last_batch_says_the_end_of_the_epoch(
    backup_dir, data, capsys
):
    # Saved after the last batch of epoch 2; its on_epoch_end never ran.
    class InterruptWithABatchEnd(InterruptAtEpochEnd):
        # Not async-safe: Keras calls every batch end on the training thread,
        # where keras-ft handles the last batch before any epoch end (on
        # Keras' thread, it would be handled at keras-ft's epoch end).
        def on_train_batch_end(self, batch, logs=None):
            pass

    with pytest.raises(RuntimeError, match="Interrupting"):
        make_model().fit(
            *data, epochs=3, batch_size=16, verbose=0,
            callbacks=[InterruptWithABatchEnd(2),
                       keras_ft.BackupAndRestore(backup_dir, save_freq=1)],
        )  # fmt: skip
    keras_ft.wait_for_backups()
    capsys.readouterr()
    model, probe = fit_probed(backup_dir, data, epochs=3)
    out = capsys.readouterr().out
    assert "resuming at the end of epoch 2/3, optimizer step 8" in out, out
    assert "batch 5" not in out
    assert iterations(model) == 3 * STEPS_PER_EPOCH


def test_continuous_saves_whenever_the_writer_is_free(tmp_path):
    backup = str(tmp_path / "backup")
    model = make_model()
    x, y = make_data()
    commits = []

    class Count(keras_ft.CheckpointListener):
        def after_commit(self, path, epoch, step):
            commits.append(step)

    model.fit(
        x, y, batch_size=4, epochs=2, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(
            backup, save_freq="continuous", delete_checkpoint=False,
            listeners=[Count()], async_save=False,
        )],
    )  # fmt: skip
    # Written in the training thread, each save is in by the next batch end:
    # one at every one of the 32 (with background writes, at every batch end
    # the last write is over: tests/test_policy.py).
    assert commits == list(range(1, 33))
    assert [n for n in checkpoint_entries(backup) if n.startswith("ckpt-")] == [
        "ckpt-00000031",
        "ckpt-00000032",
    ]  # keep=2


# Keras' own tests of its callback, run against this one.

_KERAS_TESTS = os.path.join(
    os.path.dirname(keras.__file__), "src", "callbacks", "backup_and_restore_test.py"
)
# These read Keras' private attributes (`_current_epoch`, `_weights_path`) or
# count the batches Keras' callback trains again after a restart.
_KERAS_PRIVATE = (
    "test_best_case_step",
    "test_best_case_epoch",
    "test_backup_corrupted",
)


@pytest.mark.skipif(
    not os.path.exists(_KERAS_TESTS), reason="this Keras ships no tests"
)
def test_keras_own_backup_and_restore_tests_pass_against_keras_ft(tmp_path):
    """Keras' backup_and_restore_test.py with `keras.callbacks.BackupAndRestore`
    replaced by keras-ft's: `backup_dir` gone after a finished fit()."""
    (tmp_path / "swap_backup.py").write_text(
        "import keras\nimport keras_ft\nfrom keras.src import callbacks\n"
        "callbacks.BackupAndRestore = keras_ft.BackupAndRestore\n"
        "keras.callbacks.BackupAndRestore = keras_ft.BackupAndRestore\n"
    )
    env = {**subprocess_env(), "PYTHONPATH": str(tmp_path)}
    public = " and ".join(f"not {name}" for name in _KERAS_PRIVATE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "swap_backup",
         "-p", "no:cacheprovider", "-k", public, _KERAS_TESTS],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert "PASSED" in done.stdout and "test_model_deleted_case_epoch" in done.stdout
