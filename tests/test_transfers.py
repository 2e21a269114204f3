"""Moving bytes to and from a bucket (`keras_ft/checkpoint/transfers.py`):
retries, and a large object downloaded in ranges, in place. Restores from a
real S3 server: `test_remote.py`."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from conftest import run_once_on

from keras_ft.checkpoint import transfers
from keras_ft.checkpoint.store import open_store

ONCE = run_once_on("torch", "transfers alone; the backend does not matter")


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    monkeypatch.setattr(transfers, "_BACKOFF_SECONDS", 0.0)


def flaky(failures: int, error: Exception, value="done"):
    calls = []

    def action():
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return value

    return action, calls


@ONCE
def test_a_transfer_is_retried_until_it_goes_through():
    action, calls = flaky(3, ConnectionError("reset by peer"))
    assert transfers.retried(action) == "done" and len(calls) == 4


@ONCE
def test_a_transfer_that_keeps_failing_is_an_os_error():
    action, calls = flaky(10, ConnectionError("reset by peer"))
    with pytest.raises(OSError, match="upload of k failed after 4 attempts "
                       "\\(ConnectionError: reset by peer\\)") as raised:  # fmt: skip
        transfers.as_os_error(action, "upload of k")
    assert raised.value.errno == errno.EIO and len(calls) == 4


@ONCE
@pytest.mark.parametrize("error", [FileNotFoundError("k"), transfers.Refused()])
def test_a_missing_object_or_a_refused_write_is_not_retried(error):
    action, calls = flaky(10, error)
    with pytest.raises(type(error)):
        transfers.as_os_error(action, "download of k")
    assert len(calls) == 1


@pytest.fixture
def stored(tmp_path):
    """A checkpoint in an in-memory bucket holding a file of four ranges."""
    data = np.random.default_rng(0).bytes(3 * transfers.STREAM_RANGE + 12345)
    store = open_store(f"memory://transfers-{os.getpid()}-{time.monotonic_ns()}")

    def write(staging):
        with open(os.path.join(staging, "weights.bin"), "wb") as f:
            f.write(data)

    checkpoint = store.save(write, {"step": 1})
    return store.storage, checkpoint, data


@ONCE
def test_a_large_object_arrives_in_ranges_in_place(stored, tmp_path):
    storage, checkpoint, data = stored
    path = str(tmp_path / "weights.bin")
    download = transfers.RangedDownload(
        storage, checkpoint, "weights.bin", path, len(data)
    )
    download.wait_for(transfers.STREAM_RANGE)  # The first range is enough.
    download.wait_for(len(data))
    download.stop()
    with open(path, "rb") as f:
        assert f.read() == data


@ONCE
@pytest.mark.parametrize("off_by", [-1, 1])
def test_an_object_not_of_its_manifest_size_fails_the_download(
    stored, tmp_path, off_by
):
    storage, checkpoint, data = stored
    download = transfers.RangedDownload(
        storage, checkpoint, "weights.bin", str(tmp_path / "w"), len(data) + off_by
    )
    with pytest.raises(OSError, match="not the size its manifest says"):
        download.wait_for(len(data) + off_by)
    download.stop()


@ONCE
def test_a_download_called_off_fails_its_waiters(stored, tmp_path, monkeypatch):
    """Called off while its first ranges are on their way: the ranges not
    yet asked for are never fetched, and a waiter for them is told."""
    storage, checkpoint, data = stored
    monkeypatch.setattr(transfers, "STREAM_RANGE", 1 << 20)  # Eight ranges.
    gate = threading.Event()
    fetch = storage.fs.cat_file

    def held(*args, **kwargs):
        gate.wait(10)
        return fetch(*args, **kwargs)

    monkeypatch.setattr(storage.fs, "cat_file", held)
    download = transfers.RangedDownload(
        storage, checkpoint, "weights.bin", str(tmp_path / "w"), len(data)
    )
    threading.Timer(0.2, gate.set).start()
    download.stop()
    with pytest.raises(OSError) as raised:
        download.wait_for(len(data))
    assert raised.value.errno == errno.ECANCELED
