"""`make demo` / `keras-ft demo`: keras-ft and Keras' callback, killed side by side."""

from __future__ import annotations

import re
import subprocess
import sys

import keras
import pytest
from conftest import subprocess_env


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the demo runs on the default backend; once per suite is enough",
)
def test_demo_kills_mid_epoch_and_in_a_save_and_keras_ft_ends_bitwise_equal():
    result = subprocess.run(
        [sys.executable, "-m", "keras_ft", "demo", "--kill-at-step", "95"],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # A clean screen: the demo's own lines only, no framework start-up logs.
    assert out.startswith("keras-ft demo (tensorflow)")
    assert "oneDNN" not in out and "absl" not in out and "WARNING" not in out
    lines = out.splitlines()
    ours = [line for line in lines if line.startswith("   keras-ft ")]
    theirs = [line for line in lines if line.startswith("   Keras' callback")]
    assert len(ours) == 2 and len(theirs) == 2, out
    # Mid-epoch: keras-ft continues at the last backup (step 90 or, if that
    # write was still in flight, 80) and trains exactly what is left.
    mid = re.search(
        r"killed at step 95 .*started again at step (\d+), trained (\d+) more steps "
        r"\(an exact resume: (\d+)\); ended at step 240, weights bitwise equal",
        ours[0],
    )
    assert mid and mid[2] == mid[3] and int(mid[1]) in (80, 90), ours[0]
    # Keras' callback restarts the epoch: more steps, another result.
    assert "ended at step 240," not in theirs[0]
    # Killed during a save: keras-ft's previous backup is there.
    assert "killed during the save" in ours[1] and "bitwise equal" in ours[1]
    assert "killed during the save" in theirs[1]
    assert "keras-ft resumed both times at the last backup" in out
