"""One writer per directory, and a dead writer never blocks its restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import run_once_on, subprocess_env

from keras_ft.checkpoint import lock as lock_module
from keras_ft.checkpoint.lock import DirectoryLock
from keras_ft.errors import DirectoryInUseError

# Loads lock.py alone, so the child starts in milliseconds.
_HOLDER = textwrap.dedent(
    """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules["lock"] = module
    spec.loader.exec_module(module)
    module.DirectoryLock(sys.argv[2]).acquire()
    print("locked", flush=True)
    time.sleep(120)
    """
)


def hold_in_another_process(directory):
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, lock_module.__file__, directory],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def test_second_process_is_refused_with_the_holders_pid(tmp_path):
    child = hold_in_another_process(str(tmp_path))
    try:
        with pytest.raises(DirectoryInUseError, match=f"pid {child.pid} on"):
            DirectoryLock(str(tmp_path)).acquire()
    finally:
        child.kill()
        child.wait()


def test_a_killed_holder_releases_the_lock(tmp_path):
    child = hold_in_another_process(str(tmp_path))
    child.send_signal(signal.SIGKILL)
    child.wait()
    lock = DirectoryLock(str(tmp_path))
    lock.acquire()  # The leftover file holds nothing.
    lock.release(remove=True)
    assert not os.path.exists(lock.path)


def test_same_process_takes_over_its_own_stale_lock(tmp_path):
    first = DirectoryLock(str(tmp_path))
    first.acquire()  # As if fit() raised and never released it.
    second = DirectoryLock(str(tmp_path))
    second.acquire()
    second.release()


def test_release_remove_leaves_a_live_holders_file(tmp_path):
    child = hold_in_another_process(str(tmp_path))
    try:
        DirectoryLock(str(tmp_path)).release(remove=True)
        assert os.path.exists(os.path.join(tmp_path, ".lock"))
    finally:
        child.kill()
        child.wait()


NO_POSIX_LOCKS = """
import sys

sys.modules["fcntl"] = None  # As on Windows: `import fcntl` raises ImportError.
import keras_ft

for make in (
    lambda: keras_ft.BackupAndRestore(sys.argv[1]),
    lambda: keras_ft.WorkerTrainingState(None, sys.argv[1]),
):
    try:
        make()
    except RuntimeError as e:
        print("REFUSED", e)
"""


@run_once_on("torch", "a process without fcntl; the backend does not matter")
def test_import_works_without_posix_locks_and_a_backup_says_why(tmp_path):
    backup_dir = str(tmp_path / "backup")
    result = subprocess.run(
        [sys.executable, "-c", NO_POSIX_LOCKS, backup_dir],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    refusals = [
        line for line in result.stdout.splitlines() if line.startswith("REFUSED")
    ]
    assert len(refusals) == 2, result.stdout
    for line in refusals:
        assert "POSIX file locks" in line and "WSL2" in line
    assert not os.path.exists(backup_dir)


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("precious")
    backup = tmp_path / "chief"
    backup.mkdir()
    os.symlink(target, backup / ".lock")
    with pytest.raises(ValueError, match="symlink"):
        DirectoryLock(str(backup)).acquire()
    assert target.read_text() == "precious"
    dangling = tmp_path / "chief2"
    dangling.mkdir()
    os.symlink(tmp_path / "created-by-nobody", dangling / ".lock")
    with pytest.raises(ValueError, match="symlink"):
        DirectoryLock(str(dangling)).acquire()
    assert not (tmp_path / "created-by-nobody").exists()


def test_a_fifo_or_symlinked_directory_is_refused_without_blocking(tmp_path):
    backup = tmp_path / "chief"
    backup.mkdir()
    os.mkfifo(backup / ".lock")
    with pytest.raises(ValueError, match="not a regular file"):
        DirectoryLock(str(backup)).acquire()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "linked")
    with pytest.raises(ValueError, match="is a symlink"):
        DirectoryLock(str(tmp_path / "linked")).acquire()
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    # Keras' PyDataset worker processes are forked from the trainer and
    # outlive a fit() that raised; the next fit() must get its lock back.
    held = DirectoryLock(str(tmp_path))
    held.acquire()
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # The child got copies of every descriptor; it waits.
        os.write(started, b"x")  # After fork's handlers in the child ran.
        signal.pause()
        os._exit(0)
    os.read(ready, 1)
    try:
        held.release()
        again = DirectoryLock(str(tmp_path))
        again.acquire()  # Raised DirectoryInUseError while the child lived.
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready)
        os.close(started)
