"""What a fit() does at its begin: several fit() calls of one script share
a backup, each restoring its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from conftest import (
    SAMPLES,
    backup_deleted,
    checkpoint_entries,
    iterations,
    make_model,
    run_once_on,
    subprocess_env,
)

import keras_ft
from keras_ft import fit_begin, holdings

STEPS = -(-SAMPLES // 32)  # Batches of conftest's data at fit()'s batch size.

SCRIPT = os.path.join(os.path.dirname(__file__), "phases_script.py")


def _run(work: str, *args: str) -> subprocess.CompletedProcess:
    backup, out = os.path.join(work, "backup"), os.path.join(work, "out")
    done = subprocess.run(
        [sys.executable, SCRIPT, backup, out, *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    if done.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(done.stderr[-4000:])
    return done


def _weights(work: str) -> list[np.ndarray]:
    with np.load(os.path.join(work, "out.npz")) as saved:
        return [saved[k] for k in sorted(saved, key=lambda k: int(k[4:]))]


@pytest.mark.parametrize(
    "how",
    [
        "the same callback",
        # Fits are numbered by directory: the backend does not matter.
        pytest.param("a new callback, same dir", marks=run_once_on("jax", "the same")),
    ],
)
def test_a_script_killed_in_its_second_fit_resumes_there(tmp_path, how):
    """Phase 1, compile() with another optimizer, phase 2; SIGKILL in phase
    2. The rerun's phase 1 trains nothing (its backup is phase 2's, not
    loaded: no error about phase 2's optimizer), and phase 2 resumes."""
    new = ["--new-callback"] if how != "the same callback" else []
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    _run(whole, *new)
    assert _run(killed, *new, "--kill-in-phase-2-at", "9").returncode == -signal.SIGKILL
    rerun = _run(killed, *new)
    assert rerun.returncode == 0
    with open(os.path.join(killed, "out.json")) as f:
        trained = json.load(f)
    assert trained == {"phase_1": 0, "phase_2": 18 - 8}  # From batch 9 of 18.
    for want, got in zip(_weights(whole), _weights(killed), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not os.path.exists(os.path.join(killed, "backup", "chief"))


def test_fits_are_numbered_per_backup_dir():
    first, other = "/tmp/fit-number-a", "/tmp/fit-number-b"
    assert fit_begin.fit_number(first) == 1
    assert fit_begin.fit_number(other) == 1
    assert fit_begin.fit_number(first) == 2


@pytest.mark.parametrize("batch_size", [16, 8])
def test_a_resume_whose_epoch_has_other_batches_says_so(backup_dir, data, batch_size):
    """Saved after batch 3 of 4 (batches of 16), killed, rerun with batches
    of 8: the position (3 batches) names batches of the other size, and the
    rerun is told; rerun with the same size, it is not."""

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise RuntimeError("crash")

    def fit(size, *callbacks):
        backup = keras_ft.BackupAndRestore(backup_dir, save_freq=3, verbose=0)
        make_model().fit(
            *data, batch_size=size, epochs=2, verbose=0, callbacks=[backup, *callbacks]
        )

    with pytest.raises(RuntimeError, match="crash"):
        fit(16, Crash())
    keras_ft.wait_for_backups()
    holdings.forget("fits")  # A new process.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(batch_size)
    told = [
        str(w.message) for w in caught if "an epoch of this fit()" in str(w.message)
    ]
    if batch_size == 16:
        assert not told
    else:
        (message,) = told
        assert "was saved after batch 3 of 4 of epoch 1, but an epoch" in message
        assert "this fit() has 8 (another `batch_size`, `steps_per_epoch`" in message
        assert "It resumes after batch 3 of 8: where the batches differ" in message


@pytest.mark.parametrize("notebook", [False, True])
def test_a_later_fits_backup_ends_an_earlier_fit_but_not_in_a_notebook(
    backup_dir, data, monkeypatch, notebook
):
    """Fit #2 of a process crashes, leaving its backup; a new process's fit
    #1 leaves it for its fit #2. In a notebook (cells run again in any
    order) the same cell run in a new kernel resumes it."""

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("crash")

    def fit(*callbacks):
        model = make_model()
        backup = keras_ft.BackupAndRestore(backup_dir, verbose=0)
        model.fit(*data, epochs=3, verbose=0, callbacks=[backup, *callbacks])
        return model

    first = fit().history  # Fit #1 of this "process" ends; its backup is deleted.
    with pytest.raises(RuntimeError, match="crash"):
        fit(Crash())  # Fit #2 leaves its backup of 2 epochs.
    keras_ft.wait_for_backups()
    holdings.forget("fits")  # A new process.
    monkeypatch.setattr(fit_begin, "interactive", lambda: notebook)
    model = fit()
    if notebook:  # Resumed: the third epoch trained, the backup done with.
        assert iterations(model) == 3 * STEPS
        assert backup_deleted(backup_dir)
    else:  # Left for fit #2, untouched; it returns what it returned before.
        assert iterations(model) == 0
        assert checkpoint_entries(backup_dir)
        assert model.history.epoch == first.epoch == [0, 1, 2]
        assert model.history.history == first.history
