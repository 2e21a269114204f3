"""One writer per prefix of a bucket (`keras_ft/checkpoint/lease.py`): the
lease, on a real S3 server on loopback with its conditional writes. Two
trainings on one bucket: `test_remote.py`."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from conftest import BUCKET, run_once_on

from keras_ft.checkpoint.lease import RemoteLease
from keras_ft.checkpoint.store import open_store
from keras_ft.errors import DirectoryInUseError, LeaseLapsedError

ONCE = run_once_on("torch", "an S3 server; the backend does not matter")


def storage(name: str):
    return open_store(f"s3://{BUCKET}/{name}-{time.monotonic_ns()}/chief").storage


def plant(lease: RemoteLease, **holder) -> None:
    """Another training's lease, as it writes it."""
    value = {"host": "elsewhere", "pid": 4242, "token": "theirs",
             "heartbeat": time.time(), **holder}  # fmt: skip
    lease.fs.pipe_file(lease.key, json.dumps(value).encode())


@ONCE
def test_a_live_writers_lease_is_refused_naming_it(s3_server):
    lease = RemoteLease(storage("live"), seconds=30)
    plant(lease)
    with pytest.raises(DirectoryInUseError, match="pid 4242 on elsewhere"):
        lease.acquire()
    # A process of this host that still runs (init) holds it just as well.
    plant(lease, host=socket.gethostname(), pid=1)
    with pytest.raises(DirectoryInUseError, match="pid 1 on"):
        lease.acquire()


@ONCE
@pytest.mark.parametrize(
    "holder",
    [
        {"heartbeat": time.time() - 3600},
        {"host": socket.gethostname(), "pid": 2**22 + 7},
    ],
    ids=["heartbeat too old", "its process is gone"],
)
def test_a_lapsed_lease_is_taken_over(s3_server, holder):
    lease = RemoteLease(storage("lapsed"), seconds=30)
    plant(lease, **holder)
    lease.acquire()
    lease.check()
    assert lease._read()["token"] != "theirs"
    lease.release()
    assert not lease.fs.exists(lease.key)  # Given back: removed.


@ONCE
def test_a_writer_whose_lease_was_taken_over_commits_nothing(s3_server):
    """Taken over (written by another) while held: the next heartbeat finds
    the conditional write refused, and every commit after is refused."""
    lease = RemoteLease(storage("taken"), seconds=1.5)
    lease.acquire()
    plant(lease)
    deadline = time.monotonic() + 10
    while lease._taken is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(LeaseLapsedError, match="taken over by another training "
                       "\\(pid 4242 on elsewhere\\)"):  # fmt: skip
        lease.check()
    lease.release()
    assert lease._read()["token"] == "theirs"  # Not ours to remove.


@ONCE
def test_a_later_fit_in_this_process_takes_the_lease(s3_server):
    """A fit() that raised keeps its lease until a later fit() here takes
    it: the earlier one then stops beating and commits nothing."""
    where = storage("later")
    earlier, later = RemoteLease(where, seconds=30), RemoteLease(where, seconds=30)
    earlier.acquire()
    later.acquire()
    with pytest.raises(LeaseLapsedError, match=f"pid {os.getpid()}"):
        earlier.check()
    later.check()
    earlier.release()
    assert later._read()["token"] == later._token  # Still the later one's.
    later.release()
    assert not later.fs.exists(later.key)
