"""Goodput: each attempt of a run recorded (`keras_ft/training/goodput.py`),
and `keras-ft goodput` (`keras_ft/goodput.py`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TESTS_DIR, run_once_on, subprocess_env

from keras_ft import goodput
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.training import goodput as goodput_record

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


@run_once_on("torch", "processes; the backend does not matter")
def test_a_finished_run_writes_its_record_where_named_and_its_backup_goes(tmp_path):
    """`delete_checkpoint=True` (the default): the finished run's backup
    goes, `backup_dir` with it, and `keras-ft goodput` reports both attempts
    from the file `goodput_file` named."""
    backup, record = str(tmp_path / "backup"), str(tmp_path / "goodput.json")
    process = launch(backup)
    for line in process.stdout:
        if '"first_batch_end"' in line:
            break
    time.sleep(1.0)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    finished = subprocess.Popen(
        [sys.executable, SCRIPT, backup, "--epochs", "3", "--save-freq", "2",
         "--goodput-file", record],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(),
    )  # fmt: skip
    _, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    assert not os.path.exists(backup)  # The checkpoints went, and the dir.
    shown = subprocess.run(
        [sys.executable, "-m", "keras_ft", "goodput", record],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "2 attempts" in shown.stdout and "productive" in shown.stdout


def test_the_finished_record_is_logged_and_written_bounded_where_named(
    tmp_path, caplog
):
    chief = CheckpointStore(str(tmp_path / "chief"))
    samples = [[float(t), t] for t in range(goodput_record.MAX_SAMPLES)]
    for i in range(goodput_record.MAX_KEPT_ATTEMPTS + 20):
        record = attempt(i * 10_000, (i * 10_000 + 1, i * 10_000 + 2), 0, samples)
        chief.replace_notice(f"goodput_{i:017d}.json", json.dumps(record).encode())
    path = str(tmp_path / "run.goodput.json")
    with caplog.at_level(logging.INFO, logger="keras_ft.goodput"):
        goodput.report_finished(chief, path)
    (logged,) = [r for r in caplog.records if r.name == "keras_ft.goodput"]
    assert "the run is over" in logged.getMessage()
    assert len(logged.goodput) == goodput_record.MAX_KEPT_ATTEMPTS + 20
    attempts = goodput.load_file(path)
    assert len(attempts) == goodput_record.MAX_KEPT_ATTEMPTS
    assert attempts[0]["process_start"] == 20 * 10_000  # The newest kept.
    assert all(len(a["samples"]) <= goodput_record.KEPT_SAMPLES for a in attempts)
    assert all(a["samples"][-1][1] == samples[-1][1] for a in attempts)
    assert os.path.getsize(path) < 1024 * 1024
    # A later run's end replaces it with its own attempts alone.
    for name in chief.notices("goodput_"):
        chief.remove_notice(name)
    chief.replace_notice("goodput_99999999999999999.json", json.dumps(
        attempt(5, (6, 7), 8, [[8, 0], [9, 1]])).encode())  # fmt: skip
    goodput.report_finished(chief, path)
    assert [a["process_start"] for a in goodput.load_file(path)] == [5]


def test_an_attempt_that_seems_to_start_before_the_last_ended_adds_up():
    """Two hosts' clocks, or a launcher that starts the next process before
    the last is reaped: the overlap is counted once, and nothing is
    negative."""
    first = attempt(0, (1, 2), 3, [[3, 0], [10, 70]])
    second = attempt(9.5, (11, 12), 13, [[13, 70], [20, 140]], 0, 70, "ended")
    report = goodput.summarize([first, second])
    assert report.wall == 20
    assert sum(report.seconds.values()) == pytest.approx(report.wall)
    assert min(report.seconds.values()) >= 0 and report.seconds["down"] == 0
    assert report.seconds["startup"] == pytest.approx((1 + 1) + (1 + 1))
