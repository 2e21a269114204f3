"""The `keras-ft` command, run for real in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import (
    checkpoint_entries,
    make_model,
    run_once_on,
    subprocess_env,
    tree_digest,
    weights_of,
)

import keras_ft
from keras_ft.checkpoint.lock import DirectoryLock

KERAS_FT = os.path.join(os.path.dirname(sys.executable), "keras-ft")


def keras_ft_command(*args: str) -> subprocess.CompletedProcess:
    command = (
        [KERAS_FT] if os.path.exists(KERAS_FT) else [sys.executable, "-m", "keras_ft"]
    )
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env=subprocess_env(),
        timeout=300,
    )  # fmt: skip


@pytest.fixture
def backup(tmp_path, data):
    """Three committed checkpoints and a leftover of a killed writer."""
    x, y = data
    model = make_model()
    backup_dir = str(tmp_path / "backup")
    model.fit(
        x, y, epochs=3, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, keep=3,
                                             delete_checkpoint=False)],
    )  # fmt: skip
    keras_ft.wait_for_backups()
    os.makedirs(os.path.join(backup_dir, "chief", ".staging-999-abcdef"))
    return backup_dir, model


def damage(backup_dir: str, sequence: int) -> None:
    path = os.path.join(backup_dir, "chief", f"ckpt-{sequence:08d}", "model.weights.h5")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)
        f.write(b"\x00\xff" * 4)


def test_ls_lists_checkpoints_leftovers_and_the_resume_one(backup):
    backup_dir, _ = backup
    before = tree_digest(backup_dir)
    result = keras_ft_command("ls", backup_dir)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["seq", "epoch", "batch", "step"]
    rows = [line.split() for line in lines[2:]]
    assert [r[:4] for r in rows[:3]] == [["1", "1", "0", "4"], ["2", "2", "0", "8"],
                                         ["3", "3", "0", "12"]]  # fmt: skip
    assert "a resume uses this one" in lines[4] and "good" in lines[4]
    assert "partial leftover (.staging-999-abcdef)" in lines[5]
    damage(backup_dir, 3)
    result = keras_ft_command("ls", backup_dir)
    lines = result.stdout.splitlines()
    assert "damaged:" in lines[4] and "checksum" in lines[4]
    assert "a resume uses this one" in lines[3]
    # Only read: nothing but the damage we did changed.
    after = tree_digest(backup_dir)
    assert {k for k in after if after[k] != before.get(k)} == {
        "chief/ckpt-00000003/model.weights.h5"
    }


def test_verify_exit_status_says_whether_a_resume_would_work(backup):
    backup_dir, _ = backup
    result = keras_ft_command("verify", backup_dir)
    assert result.returncode == 0, result.stderr
    assert (
        "a resume would use" in result.stdout and "ckpt-00000003: good" in result.stdout
    )
    damage(backup_dir, 3)
    result = keras_ft_command("verify", backup_dir)
    assert result.returncode == 0  # A resume falls back to ckpt 2, good.
    assert "ckpt-00000003: DAMAGED" in result.stderr
    assert "a resume would use" in result.stdout and "ckpt-00000002" in result.stdout
    damage(backup_dir, 2)
    damage(backup_dir, 1)
    result = keras_ft_command("verify", backup_dir)
    assert result.returncode == 1
    assert "no checkpoint verifies" in result.stderr


def test_a_path_that_is_not_a_backup_is_named(tmp_path):
    for command in ("ls", "verify"):
        result = keras_ft_command(command, str(tmp_path))
        assert result.returncode == 2
        assert "is not a keras-ft backup directory" in result.stderr
        assert str(tmp_path) in result.stderr
    result = keras_ft_command("ls", str(tmp_path / "missing"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = keras_ft_command("frobnicate")
    assert result.returncode == 2


def test_export_writes_files_keras_opens(backup, tmp_path):
    backup_dir, trained = backup
    model_file = str(tmp_path / "architecture.keras")
    make_model().save(model_file)  # Untrained: the backup supplies the weights.
    out = str(tmp_path / "exported.keras")
    result = keras_ft_command("export", backup_dir, "--model", model_file, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "epoch 3, step 12" in result.stdout
    exported = keras.saving.load_model(out)
    for mine, theirs in zip(weights_of(exported), weights_of(trained), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert int(exported.optimizer.iterations) == 12


@run_once_on("torch", "the weights file and the argument check do not depend on it")
def test_export_of_the_weights_alone_needs_no_model_file(backup, tmp_path):
    backup_dir, trained = backup
    model_file = str(tmp_path / "architecture.keras")
    make_model().save(model_file)
    for model_args in (["--model", model_file], []):
        weights = str(tmp_path / f"exported{len(model_args)}.weights.h5")
        result = keras_ft_command("export", backup_dir, *model_args, "--out", weights)
        assert result.returncode == 0, result.stderr
        fresh = make_model()
        fresh.optimizer.build(fresh.trainable_variables)  # Its state is in there.
        fresh.load_weights(weights)
        for mine, theirs in zip(weights_of(fresh), weights_of(trained), strict=True):
            np.testing.assert_array_equal(mine, theirs)
    result = keras_ft_command("export", backup_dir, "--out", str(tmp_path / "x.keras"))
    assert result.returncode == 2 and "needs --model" in result.stderr


def test_prune_refuses_while_a_training_holds_the_backup(backup):
    backup_dir, _ = backup
    lock = DirectoryLock(os.path.join(backup_dir, "chief"))
    lock.acquire()  # As a running fit() does.
    try:
        result = keras_ft_command("prune", backup_dir, "--keep", "1")
    finally:
        lock.release()
    assert result.returncode == 1 and "refusing" in result.stderr
    assert len(keras_ft_command("ls", backup_dir).stdout.splitlines()) == 6

    result = keras_ft_command("prune", backup_dir, "--keep", "1")
    assert result.returncode == 0, result.stderr
    assert "removed 2 checkpoints and 1 partial leftovers" in result.stdout
    assert checkpoint_entries(backup_dir) == [".lock", "ckpt-00000003"]
    result = keras_ft_command("prune", backup_dir, "--keep", "0")
    assert result.returncode == 2 and "--keep" in result.stderr


def test_prune_keeps_the_newest_good_checkpoints(backup):
    """With the newest checkpoint damaged, `--keep 1` keeps the newest one that
    verifies, deletes only older ones, and leaves the damaged one alone."""
    backup_dir, _ = backup
    damage(backup_dir, 3)
    result = keras_ft_command("prune", backup_dir, "--keep", "1")
    assert result.returncode == 0, result.stderr
    assert "kept the newest good ones: ckpt-00000002" in result.stdout
    assert "1 damaged ones left alone" in result.stdout
    assert checkpoint_entries(backup_dir) == [
        ".lock", "ckpt-00000002", "ckpt-00000003",
    ]  # fmt: skip
    # A resume still finds a good checkpoint to restore.
    assert "a resume would use" in keras_ft_command("verify", backup_dir).stdout


def test_names_from_a_backup_are_printed_escaped_and_no_traceback(backup):
    backup_dir, _ = backup
    staging = os.path.join(backup_dir, "chief", ".staging-\x1b[2J\x1b]0;pwned\x07")
    os.makedirs(staging)
    result = keras_ft_command("ls", backup_dir)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\\x1b[2J" in result.stdout
    lock = os.path.join(backup_dir, "chief", ".lock")
    os.remove(lock)
    os.symlink(os.path.join(backup_dir, "outside-lock"), lock)
    result = keras_ft_command("prune", backup_dir, "--keep", "1")
    assert result.returncode == 1 and "symlink" in result.stderr
    assert "Traceback" not in result.stderr
    assert not os.path.exists(os.path.join(backup_dir, "outside-lock"))


def test_version_is_the_installed_distributions():
    """One version, written once (keras_ft.__version__), read by the
    package's metadata and by `keras-ft --version`."""
    from importlib import metadata

    result = keras_ft_command("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"keras-ft {keras_ft.__version__}"
    assert metadata.version("keras-ft") == keras_ft.__version__


def test_a_reader_that_goes_away_ends_the_listing_quietly(backup):
    """`keras-ft ls BACKUP | head -1`: the pipe closes before the listing is
    printed; no traceback, no error line, the status a shell reports."""
    backup_dir, _ = backup
    read_end, write_end = os.pipe()
    os.close(read_end)  # Gone before anything is written.
    command = (
        [KERAS_FT] if os.path.exists(KERAS_FT) else [sys.executable, "-m", "keras_ft"]
    )
    try:
        result = subprocess.run(
            [*command, "ls", backup_dir], stdout=write_end, stderr=subprocess.PIPE,
            text=True, env=subprocess_env(), timeout=300,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert result.returncode == 141 and result.stderr == ""
