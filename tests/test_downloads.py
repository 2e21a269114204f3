"""A restore's local copy of a bucket's checkpoint
(`keras_ft/checkpoint/downloads.py`): small files whole, a large one in
ranges checksummed as it arrives, one left in the bucket for a reader to
fetch by ranges, and the copy removed once released. Restores from a real
S3 server: `test_remote.py`."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from conftest import run_once_on

from keras_ft.checkpoint import transfers
from keras_ft.checkpoint.files import DIGEST
from keras_ft.checkpoint.store import open_store

ONCE = run_once_on("torch", "the storage alone; the backend does not matter")

BIG = np.random.default_rng(1).bytes(transfers.STREAM_MIN + 4321)
FILES = {"small.json": b'{"a": 1}', "big.bin": BIG, "far.bin": b"r" * 5000}


@pytest.fixture
def bucket():
    store = open_store(f"memory://downloads-{os.getpid()}-{time.monotonic_ns()}")

    def write(staging):
        for name, data in FILES.items():
            with open(os.path.join(staging, name), "wb") as f:
                f.write(data)

    return store, store.save(write, {"step": 1})


@ONCE
def test_a_local_copy_holds_the_files_and_goes_when_released(bucket):
    store, checkpoint = bucket
    storage = store.storage
    sizes = {name: len(data) for name, data in FILES.items()}
    copy = storage.reader.local_copy(
        checkpoint, sizes, stream=frozenset({"big.bin", "small.json"}),
        ranged=frozenset({"far.bin"}),
    )  # fmt: skip
    # The checksums follow the big file as it arrives; the small one is
    # whole already (too small to stream).
    reader = storage.reader.copy_reader(copy)
    with open(copy.file("small.json"), "rb") as f:
        assert f.read() == FILES["small.json"]
    entry = store.manifest(checkpoint)["big.bin"]
    assert reader.digest(copy, "big.bin", DIGEST) == entry[DIGEST]
    with open(copy.file("big.bin"), "rb") as f:
        assert f.read() == BIG
    # Never downloaded: read by ranges from the bucket.
    assert not os.path.exists(copy.file("far.bin"))
    assert copy.ranges("far.bin", 100, 10) == b"r" * 10
    with pytest.raises(FileNotFoundError, match="not read by ranges"):
        copy.ranges("big.bin", 0, 10)
    storage.reader.release(copy)
    assert not os.path.exists(os.path.dirname(copy.path))


@ONCE
def test_a_copy_of_a_file_the_bucket_lost_is_missing_for_verification(bucket):
    """A file gone from the bucket is not an error of the download: the
    verification that follows finds it missing."""
    store, checkpoint = bucket
    storage = store.storage
    storage.fs.rm(storage._key(checkpoint, "small.json"))
    copy = storage.reader.local_copy(
        checkpoint, {name: len(d) for name, d in FILES.items()}
    )
    assert not os.path.exists(copy.file("small.json"))
    assert os.path.getsize(copy.file("far.bin")) == 5000
    storage.reader.release(copy)
