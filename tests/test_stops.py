"""StopAtStep and StopAtTime: stop where asked, back that step up, resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from conftest import (
    STEPS_PER_EPOCH,
    backup_deleted,
    iterations,
    make_model,
    run_once_on,
    subprocess_env,
)

import keras_ft


def committed_steps(backup_dir: str) -> list[int]:
    return [c.step for c in keras_ft.watch(backup_dir, timeout=0)]


class Slow(keras.callbacks.Callback):
    """Makes each batch take at least `seconds`. Put it before the stop."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class Used(keras.callbacks.Callback):
    """Records the budget used right after the stop looked. Put it after."""

    def __init__(self, stop: keras_ft.StopAtTime):
        super().__init__()
        self.stop = stop
        self.used: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.used.append(self.stop.used)


@pytest.mark.parametrize("save_freq", ["epoch", False, 3])
def test_stop_at_step_backs_up_the_step_and_a_finished_run_trains_nothing(
    backup_dir, data, save_freq, capsys
):
    x, y = data
    model = make_model()
    history = model.fit(
        x, y, epochs=5, batch_size=16, verbose=0,
        callbacks=[
            keras_ft.StopAtStep(6),
            keras_ft.BackupAndRestore(backup_dir, save_freq=save_freq),
        ],
    )  # fmt: skip
    assert iterations(model) == 6
    assert history.epoch == [0, 1]
    assert (
        committed_steps(backup_dir)[-1] == 6
    )  # The exact step, whatever the schedule.
    assert "StopAtStep: reached optimizer step 6" in capsys.readouterr().out

    # Run again: the backup is at the last step; nothing is trained, and the
    # backup stays (delete_checkpoint=True deletes only a run that finished).
    again = make_model()
    history = again.fit(
        x, y, epochs=5, batch_size=16, verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(backup_dir, save_freq=save_freq),
            keras_ft.StopAtStep(6),
        ],
    )  # fmt: skip
    assert iterations(again) == 6 and history.epoch == []
    assert "fit() ends without training" in capsys.readouterr().out
    assert committed_steps(backup_dir)[-1] == 6

    # A later step goes on from the backup.
    further = make_model()
    further.fit(
        x, y, epochs=5, batch_size=16, verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(backup_dir, save_freq=save_freq),
            keras_ft.StopAtStep(STEPS_PER_EPOCH * 5),
        ],
    )  # fmt: skip
    assert iterations(further) == STEPS_PER_EPOCH * 5
    assert backup_deleted(backup_dir)  # Every epoch ran: deleted.


def test_stop_at_time_stops_at_the_first_batch_past_the_budget(backup_dir, data):
    x, y = data
    stop = keras_ft.StopAtTime(0.6)
    used = Used(stop)
    model = make_model()
    model.fit(
        x, y, epochs=100, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), Slow(0.05), stop, used],
    )  # fmt: skip
    # The budget was spent at the last batch trained, not at the one before
    # (looked at microseconds after the stop did). On a loaded machine the
    # first batch (which compiles) may spend all of it by itself.
    assert used.used[-1] >= 0.6
    assert len(used.used) == 1 or used.used[-2] < 0.6 + 0.01
    assert stop.stopped is not None
    stopped_at = iterations(model)
    assert stopped_at < 100 * STEPS_PER_EPOCH
    assert committed_steps(backup_dir)[-1] == stopped_at

    # A fresh budget (total=False): the next run resumes at that step and
    # trains on.
    resumed = make_model()
    after_restore = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            after_restore.append(iterations(self.model))

    stop = keras_ft.StopAtTime(0.3)
    resumed.fit(
        x, y, epochs=100, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), Record(), Slow(0.05), stop],
    )  # fmt: skip
    assert after_restore == [stopped_at]
    assert iterations(resumed) > stopped_at


_TOTAL_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import keras, numpy as np
    import keras_ft

    backup_dir, seconds = sys.argv[1], float(sys.argv[2])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    stop = keras_ft.StopAtTime(seconds, total=True)

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.05)

    class Report(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print("USED", json.dumps([stop.used, stop._used_before]), flush=True)

    model.fit(x, y, epochs=1000, batch_size=16, verbose=0,
              callbacks=[keras_ft.BackupAndRestore(backup_dir), Slow(), stop,
                         Report()])
    print("DONE", json.dumps([stop.stopped, stop._used_before,
                              int(model.optimizer.iterations)]), flush=True)
    """
)


@run_once_on("torch", "three processes keep one time budget")
def test_stop_at_time_total_counts_the_budget_across_processes(tmp_path):
    """A run preempted after part of a total budget, then resumed in a new
    process, has only the rest of it; a third process has nothing left."""
    script = tmp_path / "total.py"
    script.write_text(_TOTAL_SCRIPT)
    backup_dir = str(tmp_path / "backup")

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(script), backup_dir, "2.0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=subprocess_env(),
        )  # fmt: skip

    first = start()
    for line in first.stdout:
        if line.startswith("USED") and json.loads(line[5:])[0] > 0.8:
            first.send_signal(signal.SIGTERM)  # Backs up the step and exits.
            break
    first.stdout.read()
    assert first.wait(timeout=120) == 128 + signal.SIGTERM, first.stderr.read()

    second = subprocess.run(
        [sys.executable, str(script), backup_dir, "2.0"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    done = [line for line in second.stdout.splitlines() if line.startswith("DONE")]
    stopped, used_before, steps = json.loads(done[0][5:])
    assert stopped is not None and "total budget" in stopped
    # The first process's time was carried over, so the second one trained
    # for less than the whole budget.
    assert 0.8 < used_before < 2.0
    used = [json.loads(line[5:])[0] for line in second.stdout.splitlines()
            if line.startswith("USED")]  # fmt: skip
    assert used[-1] >= 2.0 and used[-2] < 2.0 + 0.01

    third = subprocess.run(
        [sys.executable, str(script), backup_dir, "2.0"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert third.returncode == 0, third.stderr
    assert (
        "total budget" in third.stdout and "fit() ends without training" in third.stdout
    )
    assert "USED" not in third.stdout  # Not one batch trained.
    done = [line for line in third.stdout.splitlines() if line.startswith("DONE")]
    assert json.loads(done[0][5:])[2] == steps


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: keras_ft.StopAtStep(-1), "last_step=-1"),
        (lambda: keras_ft.StopAtStep(0), "last_step=0"),
        (lambda: keras_ft.StopAtStep(2.5), "last_step=2.5"),
        (lambda: keras_ft.StopAtTime(0), "seconds=0"),
        (lambda: keras_ft.StopAtTime(-3.0), "seconds=-3.0"),
        (lambda: keras_ft.StopAtTime(float("inf")), "seconds=inf"),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match="Invalid value for argument") as raised:
        make()
    assert message in str(raised.value)


def test_without_backup_and_restore_the_stop_still_stops(data):
    x, y = data
    model = make_model()
    model.fit(x, y, epochs=5, batch_size=16, verbose=0,
              callbacks=[keras_ft.StopAtStep(3)])  # fmt: skip
    assert iterations(model) == 3
    assert np.isfinite(model.evaluate(x, y, verbose=0))
