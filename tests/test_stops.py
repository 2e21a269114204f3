"""StopAtStep and StopAtTime: stop where asked, back that step up, resume."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import textwrap
import threading
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
from keras_ft.training import stops


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


class OffThread(keras.callbacks.Callback):
    """Records the thread of each batch end (async-safe: Keras may call it
    on its callback thread)."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.threads: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        self.threads.append(threading.get_ident())


def counted_reads(monkeypatch) -> list[int]:
    """The optimizer steps `StopAtStep` reads (each waits for the device):
    from the model, and from what the step it watched returned."""
    real, real_after, reads = stops.optimizer_step, stops.compat.step_after, []

    def counted(model):
        reads.append(real(model))
        return reads[-1]

    def counted_after(result, model, read):
        reads.append(real_after(result, model, real))
        return reads[-1]

    monkeypatch.setattr(stops, "optimizer_step", counted)
    monkeypatch.setattr(stops.compat, "step_after", counted_after)
    return reads


ASYNC = pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="TensorFlow's Keras calls every batch end on the training thread",
)


@ASYNC
def test_the_stops_leave_keras_dispatching_steps_ahead(backup_dir, data):
    """With every callback async-safe, Keras calls the batch ends on its own
    thread: neither stop makes it wait for every step again."""
    x, y = data
    training = threading.get_ident()
    for stop in (keras_ft.StopAtStep(6), keras_ft.StopAtTime(3600)):
        seen = OffThread()
        model = make_model()
        model.fit(
            x, y, epochs=2, batch_size=16, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=3), stop, seen],
        )  # fmt: skip
        assert seen.threads and training not in seen.threads, stop
    assert iterations(model) == 2 * STEPS_PER_EPOCH

    # A budget spent with the batch ends off the training thread: training
    # stops a step or a few later, and that step is backed up.
    stop, seen = keras_ft.StopAtTime(0.5), OffThread()
    model = make_model()
    model.fit(
        x, y, epochs=100_000, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=3), stop, seen],
    )  # fmt: skip
    assert stop.stopped is not None and training not in seen.threads
    assert iterations(model) < 100_000 * STEPS_PER_EPOCH
    assert committed_steps(backup_dir)[-1] == iterations(model)


def test_stop_at_step_reads_the_step_rarely_and_stops_exactly(
    backup_dir, data, monkeypatch
):
    """At the start, after the first step (how far one step goes), and right
    after the batch the count says reaches `last_step`; also after a resume
    that skips the epoch's trained batches (their steps do not count)."""
    x, y = data
    reads = counted_reads(monkeypatch)

    def fit_to(last_step: int) -> keras.Model:
        model = make_model()
        model.fit(
            x, y, epochs=5, batch_size=16, verbose=0, shuffle=False,
            callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=4),
                       keras_ft.StopAtStep(last_step), OffThread()],
        )  # fmt: skip
        return model

    model = fit_to(6)
    assert iterations(model) == 6 and committed_steps(backup_dir)[-1] == 6
    assert reads == [0, 1, 6]

    # Resumed at step 6, mid-epoch: 2 batches skipped, then 3 more trained.
    reads.clear()
    resumed = fit_to(9)
    assert iterations(resumed) == 9 and committed_steps(backup_dir)[-1] == 9
    assert reads == [6, 7, 9]


@pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="Keras' PyTorch trainer runs one step per execution",
)
def test_stop_at_step_stops_after_the_execution_that_reaches_it(backup_dir, data):
    x, y = data
    model = make_model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse", steps_per_execution=2)
    model.fit(
        x, y, epochs=5, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), keras_ft.StopAtStep(5)],
    )  # fmt: skip
    assert iterations(model) == 6 and committed_steps(backup_dir)[-1] == 6


def test_stop_at_step_learns_a_step_that_applies_the_optimizer_twice(data):
    """A custom train step that updates twice: learned from the first step,
    then the stop is at the first batch end at or past `last_step`."""

    class Twice(keras.Sequential):
        def train_step(self, *args, **kwargs):
            self.optimizer.iterations.assign_add(1)
            return super().train_step(*args, **kwargs)

    if keras.backend.backend() == "jax":
        pytest.skip("JAX's train step is stateless: iterations is its state")
    x, y = data
    model = Twice([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-3), loss="mse")
    stop = keras_ft.StopAtStep(9)
    model.fit(x, y, epochs=5, batch_size=16, verbose=0, callbacks=[stop])
    assert iterations(model) == 10  # 2, 4, ..., 10.
    assert "reached optimizer step 10" in stop.stopped


def test_stop_at_time_can_be_deep_copied_after_a_fit(data):
    """Keras Tuner deep-copies the callbacks of each trial: the lock that
    keeps two of Keras' threads from both stopping is not the instance's."""
    x, y = data
    stop = keras_ft.StopAtTime(3600)
    make_model().fit(x, y, epochs=1, batch_size=16, verbose=0, callbacks=[stop])
    copied = copy.deepcopy(stop)
    assert copied.seconds == 3600 and copied.stopped is None


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's state sync")
def test_stop_at_step_leaves_jax_state_where_it_is_between_reads(data, monkeypatch):
    """Reading `self.model` on JAX copies the trainer's state back into every
    variable; the count at each batch begin does without it."""
    x, y = data
    reads = counted_reads(monkeypatch)

    def syncs(callbacks: list, epochs: int) -> int:
        model = make_model()
        real, calls = model.jax_state_sync, []
        model.jax_state_sync = lambda: (calls.append(1), real())[1]
        model.fit(x, y, epochs=epochs, batch_size=16, verbose=0, callbacks=callbacks)
        return len(calls)

    last_step = 3 * STEPS_PER_EPOCH + 1  # In the fourth epoch.
    with_stop = syncs([keras_ft.StopAtStep(last_step)], epochs=10)
    assert len(reads) == 3
    # Keras' own syncs over the same four epochs, one per read, and two of
    # the callbacks' (train begin; the stop). Not one per batch (13 more).
    assert with_stop <= syncs([], epochs=4) + len(reads) + 2


def test_stop_at_step_does_not_count_a_step_a_loss_scale_optimizer_skipped(data):
    """Mixed precision's loss scaling skips a step whose gradients overflow
    (the optimizer's step stays): the stop waits for the step that counts."""
    x, y = data
    x = x.copy()
    x[2 * 16 : 3 * 16] = 1e30  # The third batch's loss overflows.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3))
    model.compile(optimizer, loss="mse")
    stop = keras_ft.StopAtStep(3)
    model.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0,
              callbacks=[stop, OffThread()])  # fmt: skip
    assert iterations(model) == 3
    assert "reached optimizer step 3" in stop.stopped
    # The wrapper that read the step after the batch is gone.
    assert not hasattr(model.train_function, "keras_ft_train")
