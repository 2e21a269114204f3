"""A checkpoint's files on this disk (`keras_ft/checkpoint/files.py`):
written from buffers and checksummed on the way, direct I/O for a big
aligned buffer, a write called off, and a backup's files opened without
following a link. Whole saves: `test_store.py`; hostile backups:
`test_hostile_backups.py`."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest
from conftest import run_once_on

from keras_ft.checkpoint import files
from keras_ft.errors import SaveCancelled

ONCE = run_once_on("torch", "files alone; the backend does not matter")


def aligned(size: int) -> memoryview:
    """A page-aligned buffer (what a snapshot's copy is), filled."""
    buffer = mmap.mmap(-1, size)
    buffer.write(np.random.default_rng(0).bytes(size))
    return memoryview(buffer)


@ONCE
@pytest.mark.parametrize(
    "chunks",
    [
        [b"abc", bytearray(b"def"), memoryview(b"ghi")],
        [np.arange(1000, dtype=np.float32), np.ones((3, 5))],
        [aligned(files._DIRECT_MIN + 3 * files._PAGE)],  # Direct I/O, in pieces.
        [],
    ],
    ids=["bytes", "arrays", "big aligned", "empty"],
)
def test_a_file_written_from_buffers_is_their_bytes_with_their_checksum(
    tmp_path, chunks
):
    path = str(tmp_path / "f.bin")
    entry = files.write_file(path, chunks)
    expected = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    with open(path, "rb") as f:
        assert f.read() == expected
    assert entry["size"] == len(expected)
    assert entry == files.entry(path)  # What reading it back gives.
    assert entry[files.DIGEST] == files.file_digest(path, files.DIGEST)


@ONCE
def test_a_write_called_off_writes_nothing_more(tmp_path):
    """Called off, the write stops before its next buffer (the staging
    directory it is in is removed with it)."""
    cancel = threading.Event()
    cancel.set()
    path = tmp_path / "f.bin"
    with pytest.raises(SaveCancelled):
        files.write_file(str(path), [b"x" * 100, b"y" * 100], cancel=cancel)
    assert not path.exists() or path.stat().st_size == 0


@ONCE
def test_reading_a_checksum_tells_how_far_it_has_read(tmp_path):
    path = str(tmp_path / "f.bin")
    files.write_file(path, [b"y" * (2 * files._CHUNK + 7)])
    told: list[int] = []
    files.file_digest(path, files.DIGEST, told.append)
    assert told == sorted(told) and told[-1] == 2 * files._CHUNK + 7


@ONCE
def test_a_backups_file_is_opened_only_if_it_is_a_regular_file(tmp_path):
    (tmp_path / "real").write_bytes(b"data")
    os.symlink(tmp_path / "real", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    os.mkdir(tmp_path / "dir")
    assert files.read_regular(str(tmp_path / "real"), 10) == b"data"
    for name in ("link", "fifo", "dir"):
        with pytest.raises(ValueError):
            files.read_regular(str(tmp_path / name), 10)
    with pytest.raises(ValueError, match="too large \\(4 bytes; at most 3"):
        files.read_regular(str(tmp_path / "real"), 3)
    with pytest.raises(FileNotFoundError):
        files.read_regular(str(tmp_path / "missing"), 10)


@ONCE
def test_a_file_reached_through_a_linked_directory_is_refused(tmp_path):
    """`<chief>/<checkpoint>/<file>`: a checkpoint directory swapped for a
    link to elsewhere is not followed."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "weights.bin").write_bytes(b"secret")
    chief = tmp_path / "chief"
    chief.mkdir()
    os.symlink(tmp_path / "elsewhere", chief / "ckpt-00000001")
    path = str(chief / "ckpt-00000001" / "weights.bin")
    assert files.read_regular(path, 10, depth=1) == b"secret"  # The file alone.
    with pytest.raises(ValueError):
        files.read_regular(path, 10, depth=files.CHIEF_FILE)
