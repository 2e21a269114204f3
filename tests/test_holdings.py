"""What a process holds between its fits: one table, by kind and path."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from keras_ft import holdings
from keras_ft.checkpoint import scratch
from keras_ft.checkpoint.lock import DirectoryLock


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="'locks'.*expected one of"):
        holdings.put("locks", "/x", 1)


def test_a_holding_is_let_go_only_by_its_holder(tmp_path):
    path = str(tmp_path)
    first, second = object(), object()
    holdings.put("writer", path, first)
    holdings.put("writer", path, second)  # A later training takes over.
    assert holdings.pop("writer", path, first) is None  # Changes nothing.
    assert holdings.get("writer", path) is second
    assert holdings.of_kind("writer")[path] is second
    assert holdings.pop("writer", path, second) is second
    assert holdings.get("writer", path) is None
    assert path not in holdings.of_kind("writer")


def test_setdefault_makes_one_and_shares_it(tmp_path):
    made = holdings.setdefault("executions", str(tmp_path), list)
    made.append(1)
    assert holdings.setdefault("executions", str(tmp_path), list) == [1]
    holdings.pop("executions", str(tmp_path))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_holds_nothing_of_its_parent_and_never_waits(tmp_path):
    """A child forked while another thread of the parent was using the table
    (a save's removal, say) uses it at once, and holds neither the parent's
    lock nor its scratch directories."""
    lock = DirectoryLock(str(tmp_path / "backup"))
    lock.acquire()
    made = scratch.make("test")
    inside, leave = threading.Event(), threading.Event()

    def busy() -> None:
        with holdings._held.guard:  # Held across the fork.
            inside.set()
            leave.wait()

    thread = threading.Thread(target=busy)
    thread.start()
    inside.wait()
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's exit code says.
            code = 1
            try:
                holdings.put("fits", "/child", 1)
                nothing = not holdings.of_kind("lock") and not holdings.of_kind(
                    "scratch"
                )
                code = 0 if nothing and holdings.get("fits", "/child") == 1 else 2
            finally:
                os._exit(code)
    finally:
        leave.set()
        thread.join()
    # A child that waits for the guard (in the fork's own handlers, too)
    # never ends by itself: it is given 30 s.
    deadline = time.monotonic() + 30
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child waited for a lock held at the fork")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    # The parent still holds both.
    assert holdings.of_kind("lock")[os.path.realpath(lock.path)] is lock
    assert made in holdings.of_kind("scratch")
    scratch.remove(made)
    lock.release(remove=True)
    assert made not in holdings.of_kind("scratch")
