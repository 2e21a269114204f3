"""A worker's throwaway saves (`keras_ft/saves/throwaway.py`): it holds only
its own temporary directory, beside the chief's (`WorkerScratch`, the
interface of the chief's `ChiefClaim`). Workers' saves in real clusters:
`test_multi_worker.py`."""

from __future__ import annotations

import os

from conftest import run_once_on

from keras_ft.checkpoint.format import chief_directory
from keras_ft.checkpoint.store import open_store
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.saves.throwaway import WorkerScratch

ONCE = run_once_on("torch", "locks and directories; the backend does not matter")


@ONCE
def test_a_worker_holds_only_its_own_directory(tmp_path):
    backup_dir = str(tmp_path / "backup")
    store = open_store(chief_directory(backup_dir))
    task = TaskSpec("worker", 1, 2, False)
    scratch = WorkerScratch(store, task, backup_dir)
    os.makedirs(scratch.path)
    with open(os.path.join(scratch.path, "stale"), "w") as f:
        f.write("a killed save's")
    scratch.acquire()
    assert not os.path.exists(scratch.path)  # Emptied: one save at a time.
    assert not os.path.exists(store.directory)  # The chief's is not touched.
    os.makedirs(scratch.path)
    scratch.delete()
    scratch.release()
    assert os.listdir(tmp_path / "backup") == []  # No trace beside the backup.


@ONCE
def test_two_workers_directories_are_their_own(tmp_path):
    backup_dir = str(tmp_path / "backup")
    store = open_store(chief_directory(backup_dir))
    first, second = (
        WorkerScratch(store, TaskSpec("worker", i, 3, False), backup_dir)
        for i in (1, 2)
    )
    assert first.path != second.path
    first.acquire()
    os.makedirs(first.path)
    second.acquire()  # Empties its own only.
    assert os.path.isdir(first.path)
    first.release()
    second.release()
