"""Where the processes' parts of one sharded save wait for the chief's
commit (`keras_ft/checkpoint/parts.py`): one protocol, on a disk and in a
bucket. Sharded saves of real clusters: `test_sharded.py`."""

from __future__ import annotations

import os
import time

import pytest
from conftest import run_once_on

from keras_ft.checkpoint.store import open_store

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
    assert {"shards-00000.bin", "shards-00001.bin"} <= store.storage.names(committed)
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
