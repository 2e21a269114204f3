"""A short run of benchmarks/kill_fuzz.py: real SIGKILLs, no failed resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import keras
from conftest import TESTS_DIR, run_once_on, subprocess_env

HARNESS = os.path.join(os.path.dirname(TESTS_DIR), "benchmarks", "kill_fuzz.py")


# Kills at random moments on every backend: test_callback's SIGKILL tests.
@run_once_on("jax", "the harness; the backend's own kills are in test_callback")
def test_short_kill_fuzz_never_fails_to_resume():
    result = subprocess.run(
        [sys.executable, HARNESS, "--trials", "4", "--callback", "keras-ft",
         "--backend", keras.backend.backend(), "--seed", "5"],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    row = re.search(r"^keras-ft\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$",
                    result.stdout, re.M)  # fmt: skip
    assert row, result.stdout
    trials, resumed, fresh, failed, lost = map(int, row.groups())
    assert trials == 4 and resumed + fresh == 4 and failed == 0, (
        result.stdout + result.stderr
    )
    assert resumed >= 1  # At least one kill landed after a backup.
