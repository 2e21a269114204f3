"""Real 2-process clusters on 127.0.0.1: kill a worker, relaunch, resume.

TensorFlow trains under `MultiWorkerMirroredStrategy`, JAX under
`keras.distribution.DataParallel` over `jax.distributed`. The harness is
`examples/local_cluster.py`, the script users run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import pytest
from conftest import TESTS_DIR, make_model, subprocess_env

import keras_ft
from keras_ft.checkpoint.store import CheckpointStore

HARNESS = os.path.join(os.path.dirname(TESTS_DIR), "examples", "local_cluster.py")
EPOCHS, STEPS_PER_EPOCH = 3, 8  # 128 samples, global batch 16.


def run_cluster(backup_dir: str, *args: str) -> dict:
    """Runs the harness: launch, kill or signal a worker, relaunch; its numbers."""
    result = subprocess.run(
        [sys.executable, HARNESS, "--backend", keras.backend.backend(),
         "--workers", "2", "--epochs", str(EPOCHS), "--seconds-per-batch", "0.1",
         "--backup-dir", backup_dir, "--json", "--quiet", *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.skipif(
    keras.backend.backend() not in ("tensorflow", "jax"),
    reason="multi-worker training is tested on TensorFlow and JAX",
)
def test_a_killed_worker_resumes_from_the_chiefs_last_commit(tmp_path):
    # One cluster run per backend keeps the suite short: TensorFlow loses the
    # chief, JAX the other worker (both work on both; see the example).
    victim = 0 if keras.backend.backend() == "tensorflow" else 1
    backup_dir = str(tmp_path / "backup")
    # Saves snapshot on the device, as "auto" does on a GPU cluster: each
    # worker's copy is moved to host memory beside its next steps.
    run = run_cluster(backup_dir, "--save-freq", "3", "--kill-window", "0.6",
                      "--kill-worker", str(victim), "--seed", str(victim),
                      "--snapshot", "device")  # fmt: skip
    assert run["exit_codes_after_kill"][str(victim)] == -9  # SIGKILL, for real.
    # Both workers restore the chief's newest commit and agree on it.
    committed = run["committed_step"]
    assert committed is not None and committed > 0
    assert run["exit_codes"] == [0, 0], run
    assert run["resumed_steps"] == [committed, committed]
    assert run["resumed_epochs"][0] == run["resumed_epochs"][1]
    # And finish with the optimizer steps of an uninterrupted run, in step.
    assert run["final_steps"] == [EPOCHS * STEPS_PER_EPOCH] * 2
    assert run["weights"][0] == run["weights"][1]
    assert run["chiefs"] == [True, False]
    # Worker temporary directories are gone; the chief holds only commits.
    assert run["backup_dir_entries"] == ["chief"]
    store = CheckpointStore(os.path.join(backup_dir, "chief"))
    names = [c.name for c in store.checkpoints()]
    kept = [n for n in run["chief_entries"] if not n.startswith("goodput_")]
    assert sorted(kept) == sorted([".lock", *names])
    for checkpoint in store.checkpoints():
        store.verify(checkpoint)


@pytest.mark.skipif(
    keras.backend.backend() not in ("tensorflow", "jax"),
    reason="multi-worker training is tested on TensorFlow and JAX",
)
def test_sigterm_to_one_worker_backs_up_one_step_on_all_and_exits(tmp_path):
    run = run_cluster(str(tmp_path / "backup"), "--save-freq", "5",
                      "--kill-window", "0.3", "--kill-worker", "1",
                      "--signal", "TERM", "--seed", "3")  # fmt: skip
    # Both stopped by themselves, as a preempted process should: 128 + 15.
    assert run["exit_codes_after_kill"] == {"0": 143, "1": 143}
    # The final backup is the signal's: after the step the signalled worker
    # had reached, taken by both workers together.
    committed = run["committed_step"]
    assert committed > run["killed_after_step"]
    assert run["exit_codes"] == [0, 0], run["stderr_of_failed"]
    assert run["resumed_steps"] == [committed, committed]
    assert run["final_steps"] == [EPOCHS * STEPS_PER_EPOCH] * 2
    assert run["weights"][0] == run["weights"][1]
    assert run["backup_dir_entries"] == ["chief"]


def test_time_based_saves_are_refused_with_several_workers(backup_dir, data):
    callback = keras_ft.BackupAndRestore(backup_dir, save_freq="auto")
    with pytest.raises(ValueError, match=r"save_freq='auto'.*save_freq='auto'"):
        callback._check_cluster(keras_ft.TaskSpec("worker", 1, 2, False))
    callback._check_cluster(keras_ft.TaskSpec())  # One process: fine.
    model = make_model()
    model.fit(*data, epochs=1, verbose=0, callbacks=[callback])
