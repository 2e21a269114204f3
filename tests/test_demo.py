"""`make demo` / `keras-ft demo`: kill, resume, same number of steps."""

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
def test_demo_kills_resumes_and_matches_the_uninterrupted_steps():
    result = subprocess.run(
        [sys.executable, "-m", "keras_ft", "demo", "--kill-after-epoch", "3"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "killed the training process with SIGKILL in epoch 4" in out
    assert "BackupAndRestore: restored" in out
    # Epoch 3's backup may still have been in flight (written in the
    # background), and on a loaded machine the kill may land epochs later.
    resumed = re.search(r"resumed at epoch (\d) and ran epochs (\d)-8", out)
    assert resumed, out
    assert 3 <= int(resumed[1]) == int(resumed[2]) <= 8, out
    assert "160 optimizer steps after the crash and resume, 160 uninterrupted" in out
    assert "the same. Nothing was lost." in out
