"""Goodput: each attempt of a run recorded, and `keras-ft goodput`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TESTS_DIR, run_once_on, subprocess_env

from keras_ft import goodput
from keras_ft.checkpoint.store import CheckpointStore

SCRIPT = os.path.join(TESTS_DIR, "train_script.py")


def attempt(start, restore, first, samples, saves=0.0, resumed=0, status=None):
    return {
        "process_start": start, "train_begin": restore[0],
        "restore_begin": restore[0], "restore_end": restore[1],
        "resumed_step": resumed, "samples": [[first, samples[0][1]], *samples[1:]],
        "save_seconds": saves, "end": None, "status": status,
    }  # fmt: skip


def test_the_categories_add_up_to_the_wall_time():
    """Attempt 1 trains steps 0-100 in 100 s and dies; attempt 2 resumes at
    step 60 (40 s of attempt 1 are lost) after 30 s down, and finishes."""
    first = attempt(0, (5, 6), 10, [[10, 0], [60, 50], [110, 100]], saves=4)
    second = attempt(140, (143, 147), 150, [[150, 60], [190, 100]], 2, 60, "ended")
    report = goodput.summarize([first, second])
    assert report.wall == 190 and report.attempts == 2
    assert sum(report.seconds.values()) == pytest.approx(report.wall)
    assert report.seconds["lost"] == pytest.approx(110 - 70)  # Step 60 at t=70.
    assert report.seconds["down"] == pytest.approx(30)
    assert report.seconds["restore"] == pytest.approx(1 + 4)
    assert report.seconds["startup"] == pytest.approx((5 + 4) + (3 + 3))
    assert report.seconds["checkpointing"] == pytest.approx(6)
    assert report.seconds["productive"] == pytest.approx(100 - 4 - 40 + 40 - 2)
    assert "goodput" in goodput.describe(report)


def launch(backup: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, backup, "--epochs", "30", "--save-freq", "2",
         "--seconds-per-batch", "0.05", "--keep-backup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(),
    )  # fmt: skip


@run_once_on("torch", "processes; the backend does not matter")
def test_a_run_killed_twice_reports_figures_that_add_up(tmp_path):
    backup = str(tmp_path / "backup")
    chief = os.path.join(backup, "chief")
    for _ in range(2):
        process = launch(backup)
        for line in process.stdout:
            if '"first_batch_end"' in line:
                break
        time.sleep(1.5)  # A few saves and goodput samples.
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finished = launch(backup)
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    attempts = goodput.load_attempts(CheckpointStore(chief))
    assert len(attempts) == 3
    assert [a["status"] for a in attempts] == [None, None, "ended"]
    assert attempts[1]["resumed_step"] > 0 and attempts[2]["resumed_step"] > 0
    report = goodput.summarize(attempts)
    assert sum(report.seconds.values()) == pytest.approx(report.wall)
    assert report.seconds["down"] > 0 and report.seconds["restore"] > 0
    assert 0 < report.goodput < 1

    picture = str(tmp_path / "timeline.png")
    shown = subprocess.run(
        [sys.executable, "-m", "keras_ft", "goodput", backup, "--png", picture],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "3 attempts" in shown.stdout and "productive" in shown.stdout
    from PIL import Image

    with Image.open(picture) as image:
        assert image.format == "PNG" and image.size == (800, 400)
        colours = {c for _, c in image.getcolors(1 << 20)}
    assert (255, 0, 0) in colours and (0, 128, 0) in colours  # Failures, resumes.
