"""A checkpoint read as it is verified (`keras_ft/checkpoint/verify.py`): a
reader follows the verification, learns how far each file is checked, and
counts only if the whole checkpoint is good. Damaged checkpoints skipped
for older ones: `test_store.py`."""

from __future__ import annotations

import os

import pytest
from test_store import flip_byte, payload, truncate, write_payload

from keras_ft.checkpoint import files
from keras_ft.checkpoint.store import CheckpointStore


def test_a_read_alongside_verification_follows_it_and_counts_only_if_good(
    tmp_path,
):
    store = CheckpointStore(str(tmp_path))
    size = 3 * files._CHUNK + 123  # Checksummed in four pieces.
    good = os.urandom(size)
    store.save(write_payload(good), {"i": 1})
    newest = store.save(write_payload(os.urandom(size)), {"i": 2})
    flip_byte(newest.file("payload.bin"))
    seen = []

    def read(checkpoint, progress):
        # Each piece waits for the checksum to have read it.
        for end in range(files._CHUNK, size + files._CHUNK, 1 << 22):
            progress.wait_for("payload.bin", min(end, size))
        seen.append(checkpoint.sequence)
        return payload(checkpoint)

    with pytest.warns(UserWarning, match="checksum"):
        checkpoint, metadata, result = store.latest_good_read(read)
    # The damaged newest was read too, but its result was dropped.
    assert seen == [2, 1]
    assert (checkpoint.sequence, metadata, result) == (1, {"i": 1}, good)


def test_verification_tells_how_far_it_has_read_each_file(tmp_path):
    store = CheckpointStore(str(tmp_path))
    size = 2 * files._CHUNK + 5
    checkpoint = store.save(write_payload(os.urandom(size)), {"i": 1})
    told = []

    class Recorder(files.ReadProgress):
        def advance(self, name, level):
            told.append((name, level))
            super().advance(name, level)

    progress = Recorder()
    store.verify(checkpoint, progress)
    chunk = files._CHUNK
    # Small files first, each whole: a reader following the verification
    # parses them while the big file is still being checked.
    small = [t for t in told if t[0] != "payload.bin"]
    assert small and told[: len(small)] == small
    for name, level in small:
        assert level == os.path.getsize(checkpoint.file(name)), name
    # Then the big one, piece by piece, in order.
    assert told[len(small) :] == [
        ("payload.bin", chunk),
        ("payload.bin", 2 * chunk),
        ("payload.bin", size),
    ]
    progress.wait_for("payload.bin", size)  # Returns: it has all been read.


def test_a_read_error_is_raised_only_for_a_good_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(write_payload(b"a" * 100), {"i": 1})
    newest = store.save(write_payload(b"b" * 100), {"i": 2})

    def read(checkpoint, progress):
        raise ValueError(f"cannot read {checkpoint.name}")

    with pytest.raises(ValueError, match="cannot read ckpt-00000002"):
        store.latest_good_read(read)
    truncate(newest.file("payload.bin"))
    with (
        pytest.warns(UserWarning, match="truncated"),
        pytest.raises(ValueError, match="cannot read ckpt-00000001"),
    ):
        store.latest_good_read(read)


def test_a_reader_waiting_for_a_file_verification_never_reads_is_let_go(
    tmp_path,
):
    store = CheckpointStore(str(tmp_path))
    store.save(write_payload(b"x" * 100), {"i": 1})

    def read(checkpoint, progress):
        progress.wait_for("not-in-the-manifest.bin", 10**9)
        return "done"

    assert store.latest_good_read(read)[2] == "done"
