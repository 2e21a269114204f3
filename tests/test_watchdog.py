"""Bounds a blocked training thread cannot stop: the stall deadline, and a
SIGTERM seen by a thread."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import TESTS_DIR, make_model, run_once_on, subprocess_env

import keras_ft
from keras_ft.training.watchdog import (
    RETRYABLE_EXIT_CODE,
    FitDeadline,
    ProgressDeadline,
    check_stall_timeout,
)

SCRIPT = os.path.join(TESTS_DIR, "blocked_script.py")
ONCE = run_once_on("torch", "processes and signals; the backend does not matter")
CLOCK = run_once_on("torch", "a thread and a clock; the backend does not matter")


def deadline(**kwargs):
    exits: list[int] = []
    made = ProgressDeadline(exit=exits.append, **kwargs)
    return made, exits


@CLOCK
def test_no_false_alarm_with_a_slow_first_batch_and_jittery_batches():
    """A first batch 3x the later bound, then batches 0.1-0.3 s apart (3x
    jitter) under a bound of 10x the slowest with a 0.5 s floor."""
    watch, exits = deadline(first_batch_seconds=5.0, floor_seconds=0.5)
    try:
        time.sleep(1.5)  # The first batch compiles.
        watch.batch_ended()
        for pause in [0.1, 0.3, 0.1, 0.2, 0.3, 0.1] * 2:
            time.sleep(pause)
            watch.batch_ended()
        assert watch.bound() == pytest.approx(3.0, abs=0.5)
        time.sleep(1.0)
    finally:
        watch.close()
    assert exits == []


@CLOCK
def test_a_stall_ends_the_process_with_the_retryable_code(capsys):
    watch, exits = deadline(
        first_batch_seconds=5.0, floor_seconds=1.0, describe=lambda: "epoch 2, batch 7"
    )
    try:
        watch.batch_ended()
        time.sleep(0.2)
        watch.batch_ended()
        started = time.monotonic()
        while not exits and time.monotonic() - started < 10:
            time.sleep(0.1)
        waited = time.monotonic() - started
    finally:
        watch.close()
    assert exits == [RETRYABLE_EXIT_CODE]
    assert 1.0 <= waited < 3.0
    said = capsys.readouterr().out
    assert "while waiting for epoch 2, batch 7" in said and "status 75" in said


@CLOCK
@pytest.mark.parametrize("peers_first", [False, True])
def test_the_process_its_peers_need_outlives_their_deadlines(peers_first):
    """JAX's process 0 hosts the service whose end aborts the others: past
    its deadline it waits about a batch and a few looks more, so that a
    peer's deadline (its last batch ended a batch later) ends it first."""
    watch, exits = deadline(
        first_batch_seconds=5.0, seconds=1.0, peers_first=peers_first
    )
    try:
        watch.batch_ended()
        time.sleep(0.4)
        watch.batch_ended()  # The slowest batch: 0.4 s.
        started = time.monotonic()
        while not exits and time.monotonic() - started < 10:
            time.sleep(0.05)
        waited = time.monotonic() - started
    finally:
        watch.close()
    assert exits == [RETRYABLE_EXIT_CODE]
    assert watch.linger_seconds() == pytest.approx(0.4 + 1.5, abs=0.1)
    if peers_first:
        assert 1.0 + 1.9 <= waited < 1.0 + 1.9 + 1.5, waited
    else:
        assert 1.0 <= waited < 1.0 + 1.5, waited


@CLOCK
def test_a_deadline_of_a_training_that_ended_never_fires():
    watch, exits = deadline(first_batch_seconds=0.5, running=lambda: False)
    try:
        time.sleep(1.5)
    finally:
        watch.close()
    assert exits == []


@CLOCK
def test_paused_holds_the_deadline_off():
    watch, exits = deadline(first_batch_seconds=0.5)
    try:
        with watch.paused():
            time.sleep(1.5)
    finally:
        watch.close()
    assert exits == []


def input_only(watch: ProgressDeadline) -> FitDeadline:
    """A fit's deadline that only the input's worker processes asked for."""
    fit = FitDeadline()
    fit._deadline, fit._input_only = watch, True
    return fit


@CLOCK
def test_validation_holds_the_epoch_end_after_it_whenever_the_last_batch_is_heard():
    # Where Keras calls the batch ends on its own thread, the epoch's last one
    # may be heard once validation began: validation stays bounded, and the
    # epoch-end work after it (another callback's, a large save) is not.
    watch, exits = deadline(first_batch_seconds=0.5, seconds=0.5)
    fit = input_only(watch)
    try:
        fit.test_begin()
        fit.batch_ended(last_of_epoch=True)  # Heard late.
        time.sleep(1.5)
        assert exits == [RETRYABLE_EXIT_CODE]  # A stalled validation ends it.
    finally:
        watch.close()

    watch, exits = deadline(first_batch_seconds=0.5, seconds=0.5)
    fit = input_only(watch)
    try:
        fit.test_begin()
        fit.test_end()
        time.sleep(1.5)  # Epoch-end work of other callbacks.
        assert exits == []
        fit.epoch_begin()  # Batches again: bounded again.
        time.sleep(1.5)
        assert exits == [RETRYABLE_EXIT_CODE]
    finally:
        watch.close()


@pytest.mark.parametrize(
    "value", ["fast", 0, -3, True, [1]], ids=["str", "zero", "negative", "bool", "list"]
)
def test_bad_stall_timeouts_are_named(value):
    with pytest.raises(ValueError, match="argument `stall_timeout`"):
        check_stall_timeout(value, 60)
    with pytest.raises(ValueError, match="argument `stall_timeout`"):
        keras_ft.BackupAndRestore("/tmp/unused", stall_timeout=value)
    with pytest.raises(ValueError, match="argument `first_batch_timeout`"):
        keras_ft.BackupAndRestore("/tmp/unused", first_batch_timeout=0)


def test_the_deadline_is_on_by_default_only_in_a_cluster(tmp_path, data):
    """Single process, arrays, default: no deadline thread during fit()."""
    x, y = data
    seen = []

    def deadlines():
        return {t for t in threading.enumerate() if t.name == "keras-ft-deadline"}

    # Another test's fit() that raised may have left its deadline running
    # (it ends once it sees that fit() is over).
    earlier = deadlines()

    class Look(keras_ft.BackupAndRestore.__mro__[1]):  # keras.callbacks.Callback
        def on_train_batch_end(self, batch, logs=None):
            seen.append(bool(deadlines() - earlier))

    for stall_timeout, expected in [(None, False), ("auto", True)]:
        seen.clear()
        make_model().fit(
            x, y, epochs=1, batch_size=32, verbose=0,
            callbacks=[
                keras_ft.BackupAndRestore(
                    str(tmp_path / str(expected)), stall_timeout=stall_timeout
                ),
                Look(),
            ],
        )  # fmt: skip
        assert seen and set(seen) == {expected}
    assert not deadlines() - earlier


def launch(backup_dir: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, backup_dir, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(),
    )  # fmt: skip


def wait_blocked(process: subprocess.Popen) -> list[str]:
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("BLOCKED"):
            return lines
    raise AssertionError("never blocked: " + "".join(lines) + process.stderr.read())


def resumed_at(backup_dir: str) -> int:
    state = keras_ft.WorkerTrainingState(make_model(), backup_dir)
    return state.checkpoints()[-1].sequence


@ONCE
def test_a_stuck_training_exits_retryably_and_its_backup_resumes(tmp_path):
    backup = str(tmp_path / "backup")
    process = launch(backup, "--block-at", "5", "--how", "python",
                     "--stall-timeout", "2")  # fmt: skip
    wait_blocked(process)
    started = time.monotonic()
    out, err = process.communicate(timeout=60)
    assert process.returncode == RETRYABLE_EXIT_CODE, err
    assert time.monotonic() - started < 20
    assert "while waiting for epoch 2, batch 6" in out
    # Relaunched, the run resumes from the backup at epoch 2, batch 4.
    again = subprocess.run(
        [sys.executable, SCRIPT, backup], capture_output=True, text=True,
        env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "resuming at epoch 2/3, batch 5" in again.stdout, again.stdout


@ONCE
def test_sigterm_ends_a_process_whose_training_thread_is_blocked_in_c(tmp_path):
    """No Python handler can run (as in a collective whose peer died): the
    grace period still ends the process, saying there is no final backup."""
    backup = str(tmp_path / "backup")
    process = launch(backup, "--block-at", "5", "--how", "c",
                     "--grace-period", "3")  # fmt: skip
    wait_blocked(process)
    time.sleep(0.5)  # Inside the C call.
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert 3.0 <= time.monotonic() - started < 20
    assert "blocked" in out and "without a final backup" in out, out
    assert "backed up" not in out
    committed = resumed_at(backup)
    assert committed >= 1


LOST_WORKER = """
import os, signal, sys, time
import keras, numpy as np
import keras_ft
from keras_ft.training import watchdog

watchdog.STALL_FLOOR_SECONDS = 2.0  # 120 s by default.
ARMED = os.path.join(sys.argv[1] + "-armed")

class Items(keras.utils.PyDataset):
    def __len__(self):
        return 40

    def __getitem__(self, index):
        try:
            os.remove(ARMED)
        except FileNotFoundError:
            pass
        else:  # The OOM killer ends this worker halfway through an item.
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)
        x = np.full((8, 4), index / 40, "float32")
        return x, x[:, :1]

class Arm(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5:
            open(ARMED, "w").close()
            print("ARMED", flush=True)

class Slow(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if not getattr(self, "began", False):
            self.began = True
            time.sleep(4)  # The first batch compiles.

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(4)  # Saving a large model, say: not a stall.

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
kill = sys.argv[2] == "kill"
model.fit(
    Items(workers=2, use_multiprocessing=True),
    validation_data=None if kill else Items(workers=2, use_multiprocessing=True),
    epochs=1 if kill else 2, verbose=0,
    callbacks=[
        Arm() if kill else Slow(),
        keras_ft.BackupAndRestore(sys.argv[1], save_freq=2),
    ],
)
print("FINISHED")
"""


def live_in_session(session: int) -> list[int]:
    """The processes of `session` that are running (not zombies)."""
    live = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
        except OSError:
            continue
        if int(sid) == session and state != "Z":
            live.append(int(pid))
    return live


@ONCE
def test_a_killed_input_worker_ends_the_wait_retryably(tmp_path):
    """Keras waits for ever for the item of a `PyDataset` worker process
    that was killed: by default the deadline bounds it, and the process ends
    with the retryable status, taking its worker processes with it."""
    process = subprocess.Popen(
        [sys.executable, "-c", LOST_WORKER, str(tmp_path / "backup"), "kill"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(), start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=120)
        assert "ARMED" in out, err
        assert process.returncode == RETRYABLE_EXIT_CODE, (out, err)
        assert "no batch ended" in out and "while waiting for epoch 1" in out, out
        deadline = time.monotonic() + 10
        while live_in_session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live_in_session(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


@ONCE
def test_the_input_workers_deadline_leaves_epoch_end_work_alone(tmp_path):
    """A deadline on only for the input's worker processes bounds the waits
    for batches (validation's included), not another callback's epoch-end
    work, and the first batch has `first_batch_timeout`: a fit() whose first
    batch and epoch ends are slower than the bound still finishes."""
    result = subprocess.run(
        [sys.executable, "-c", LOST_WORKER, str(tmp_path / "backup"), "slow"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "FINISHED" in result.stdout and "no batch ended" not in result.stdout
