"""Where the processes' parts of one sharded save wait for the chief's
commit (`keras_ft/checkpoint/parts.py`): one protocol, on a disk and in a
bucket. Sharded saves of real clusters: `test_sharded.py`. And the parts a
`WorkerTrainingState` is made of (`keras_ft/saves/parts.py`), by task."""

from __future__ import annotations

import os
import time

import pytest
from conftest import make_model, run_once_on

from keras_ft.checkpoint.store import open_store
from keras_ft.distribute.cluster import TaskSpec, worker_temp_name
from keras_ft.options import BackupOptions
from keras_ft.saves.claims import ChiefClaim
from keras_ft.saves.parts import assemble
from keras_ft.saves.throwaway import WorkerScratch
from keras_ft.state import TrainingState

ONCE = run_once_on("torch", "the storage alone; the backend does not matter")


@pytest.fixture(params=["disk", "bucket"])
def store(request, tmp_path):
    if request.param == "disk":
        return open_store(str(tmp_path / "chief"))
    return open_store(f"memory://parts-{os.getpid()}-{time.monotonic_ns()}/chief")


def commit_parts(store, parts, names: list[str]):
    """The chief's commit: each process's file and index adopted."""
    entries = {
        name: parts.write_data(f"{name}.bin", [name.encode() * 100], None)
        for name in names
    }
    for name in names:
        parts.write_index(f"{name}.json", b'{"done": true}')

    def write(staging):
        for name in names:
            assert parts.read_index(f"{name}.json", 1024) == b'{"done": true}'
            parts.adopt(staging, f"{name}.bin", entries[name])
            parts.adopt_index(staging, f"{name}.json", b'{"done": true}')

    committed = store.save(write, {"step": 1})
    parts.close()
    return committed


@ONCE
def test_the_parts_become_files_of_one_checkpoint(store):
    parts = store.storage.parts("00000001", store.storage.next_sequence())
    assert parts.read_index("shards-00000.json", 1024) is None  # Not yet.
    committed = commit_parts(store, parts, ["shards-00000", "shards-00001"])
    store.verify(committed)
    assert {"shards-00000.bin", "shards-00001.bin"} <= store.storage.reader.names(
        committed
    )
    assert store.leftovers() == []  # Nothing waits any more.


@ONCE
def test_an_index_is_read_whole_or_not_at_all(store):
    parts = store.storage.parts("00000001", store.storage.next_sequence())
    parts.write_index("shards-00000.json", b"x" * 100)
    assert parts.read_index("shards-00000.json", 100) == b"x" * 100
    parts.discard()


@ONCE
def test_a_failed_save_leaves_no_part(store):
    parts = store.storage.parts("00000001", store.storage.next_sequence())
    parts.write_data("shards-00000.bin", [b"data"], None)
    parts.write_index("shards-00000.json", b"{}")
    parts.discard()
    assert store.checkpoints() == [] and store.leftovers() == []
    assert parts.read_index("shards-00000.json", 1024) is None


@ONCE
def test_the_parts_of_an_earlier_save_are_removed(tmp_path):
    """On a disk, parts of saves called off or killed wait beside the
    checkpoints until a later save removes them (in a bucket they are the
    next writer's leftovers, `test_remote.py`)."""
    store = open_store(str(tmp_path / "chief"))
    earlier = store.storage.parts("00000001", 1)
    earlier.write_data("shards-00000.bin", [b"killed"], None)
    later = store.storage.parts("00000002", 1)
    later.write_data("shards-00000.bin", [b"now"], None)
    later.remove_earlier()
    assert not os.path.exists(earlier.where) and os.path.exists(later.where)
    later.discard()


class Training:
    """Stands for the `WorkerTrainingState` whose lifetime the queue follows."""


@ONCE
def test_a_chief_and_a_worker_are_assembled_from_the_same_options(tmp_path):
    backup_dir = str(tmp_path / "backup")
    options = BackupOptions(backup_dir)
    state = TrainingState(make_model())
    chief = assemble(Training(), state, TaskSpec(), options, [])
    assert chief.store.directory == os.path.join(backup_dir, "chief")
    assert chief.root.location == backup_dir
    assert isinstance(chief.claim, ChiefClaim)
    assert chief.throwaway is None and chief.tiers.local is None
    worker_task = TaskSpec("worker", 1, num_workers=2, is_chief=False)
    worker = assemble(Training(), state, worker_task, options, [])
    # The worker reads the chief's checkpoints, and throws its own saves away
    # in a scratch directory beside them.
    assert worker.store.directory == chief.store.directory
    assert isinstance(worker.claim, WorkerScratch)
    assert worker.claim.path == os.path.join(backup_dir, worker_temp_name(1))
    assert worker.throwaway is not None
    assert not os.path.exists(backup_dir)  # Nothing is written until a save.


@ONCE
def test_a_bucket_with_a_local_dir_gets_a_tier_for_each_process(tmp_path):
    bucket = f"memory://assembled-{os.getpid()}-{time.monotonic_ns()}"
    options = BackupOptions(bucket, local_dir=str(tmp_path / "fast"))
    state = TrainingState(make_model())
    task = TaskSpec("worker", 1, num_workers=2, is_chief=False)
    parts = assemble(Training(), state, task, options, [])
    assert parts.store.directory == f"{bucket}/chief"
    assert parts.tiers.local is not None
    assert parts.tiers.local.directory.startswith(str(tmp_path / "fast"))
    assert parts.tiers.local.directory.endswith("-process-1")
    # With a tier, a worker keeps its saves there: none are thrown away.
    assert parts.throwaway is None
