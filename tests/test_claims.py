"""Who holds a backup (`keras_ft/saves/claims.py`): the chief its lock
(another worker its own temporary directory: `test_throwaway.py`). Through
whole trainings: `test_callback.py`, `test_multi_worker.py`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import run_once_on

from keras_ft import threads
from keras_ft.checkpoint.format import chief_directory
from keras_ft.checkpoint.store import open_storage, open_store
from keras_ft.saves.claims import ChiefClaim

ONCE = run_once_on("torch", "locks and directories; the backend does not matter")


def chief_claim(backup_dir: str) -> ChiefClaim:
    store = open_store(chief_directory(backup_dir))
    return ChiefClaim(store, store.writer_lock(), open_storage(backup_dir, None))


def write(staging) -> None:
    with open(os.path.join(staging, "weights.bin"), "wb") as f:
        f.write(b"w" * 64)


def holds_lock(directory: str) -> bool:
    """Whether another process is refused the lock (`DirectoryInUseError`)."""
    code = (
        "import sys\n"
        "from keras_ft.checkpoint.lock import DirectoryLock\n"
        "from keras_ft.errors import DirectoryInUseError\n"
        "try:\n"
        f"    DirectoryLock({directory!r}).acquire()\n"
        "except DirectoryInUseError:\n"
        "    sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-c", code], env=env).returncode == 3


@ONCE
def test_the_chief_locks_and_removes_what_a_killed_writer_left(tmp_path):
    backup_dir = str(tmp_path / "backup")
    claim = chief_claim(backup_dir)
    store = open_store(chief_directory(backup_dir))
    kept = store.save(write, {"step": 1})
    store.storage.stage(None)  # A save a killed writer left uncommitted.
    assert store.leftovers()
    claim.acquire()
    assert store.leftovers() == [] and store.checkpoints() == [kept]
    assert holds_lock(store.directory)
    claim.release()
    assert not holds_lock(store.directory)


@ONCE
def test_the_chief_deletes_the_backup_and_its_lock(tmp_path):
    backup_dir = str(tmp_path / "backup")
    claim = chief_claim(backup_dir)
    claim.acquire()
    open_store(chief_directory(backup_dir)).save(write, {"step": 1})
    claim.delete()
    threads.wait_for_removals()
    assert not os.path.exists(chief_directory(backup_dir))
    assert not holds_lock(chief_directory(backup_dir))


@ONCE
def test_a_backup_that_cannot_be_deleted_is_a_warning_and_the_lock_goes(
    tmp_path, monkeypatch
):
    """Training is over when the backup is deleted: a storage that fails
    then is said, not raised, and the lock is released all the same."""
    backup_dir = str(tmp_path / "backup")
    claim = chief_claim(backup_dir)
    claim.acquire()
    store = claim._store
    store.save(write, {"step": 1})

    def unreachable(beside=None):
        raise ConnectionError("the bucket is out of reach")

    monkeypatch.setattr(store, "clear", unreachable)
    with pytest.warns(UserWarning, match="could not be deleted.*out of reach"):
        claim.delete()
    assert len(store.checkpoints()) == 1
    assert not holds_lock(store.directory)
