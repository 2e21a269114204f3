"""One training's saves in flight on its own writer
(`keras_ft/saves/queue.py`): in order, a save that replaces the last calling
it off, synchronous or not, and one holder per directory, whose writes a
later training waits for, that lets go of the thread pools. Through whole
trainings: `test_callback.py`."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from conftest import make_model, run_once_on

import keras_ft
from keras_ft import holdings
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.errors import CheckpointWriteError
from keras_ft.saves.queue import SaveQueue
from keras_ft.saves.save import Save

ONCE = run_once_on("torch", "threads; the backend does not matter")


class Training:
    """What a queue asks of the training it belongs to: to finish its
    writes, and to let go of its lock."""

    def __init__(self, error: Exception | None = None):
        self.error, self.calls = error, []

    def wait(self):
        self.calls.append("wait")
        if self.error is not None:
            raise self.error

    def unlock(self):
        self.calls.append("unlock")


def directory() -> str:
    return f"/backups/{time.monotonic_ns()}"  # A writer of its own.


def commit(save: Save) -> Checkpoint:
    """A saver's commit: the save's `snapshot` stands for its number here."""
    sequence, seen, hold = save.snapshot
    if hold is not None:
        hold.wait(10)
    seen.append((sequence, save.cancel.is_set(), save.replaced))
    return Checkpoint(sequence, f"ckpt-{sequence}")


def start(queue, sequence: int, seen: list, hold=None, replaces_last=False):
    save = Save((sequence, seen, hold))
    queue.start(commit, save, replaces_last)
    return save.cancel


@ONCE
@pytest.mark.parametrize("async_save", [True, False])
def test_saves_commit_in_order_and_return_when_asked(async_save):
    training = Training()
    queue = SaveQueue(directory(), async_save, training)
    seen: list = []
    for sequence in (1, 2, 3):
        start(queue, sequence, seen)
        committed = queue.committed()
        if async_save:
            assert committed is None
        else:  # Written before the save returns.
            assert committed.sequence == sequence and len(seen) == sequence
    newest = queue.wait()  # In flight: none left where each was waited for.
    assert newest.sequence == 3 if async_save else newest is None
    assert [s for s, _, _ in seen] == [1, 2, 3]


@ONCE
def test_a_save_that_replaces_the_last_calls_it_off():
    queue = SaveQueue(directory(), True, Training())
    seen: list = []
    hold = threading.Event()
    first_cancel = start(queue, 1, seen, hold)
    second_cancel = start(queue, 2, seen, replaces_last=True)
    assert first_cancel.is_set() and not second_cancel.is_set()
    hold.set()
    queue.wait()
    (first, called_off, _), (second, _, replaced) = seen
    assert (first, called_off, second) == (1, True, 2)
    assert replaced is not None and replaced.result().sequence == 1


@ONCE
def test_discarding_calls_off_every_save_in_flight():
    queue = SaveQueue(directory(), True, Training())
    seen: list = []
    hold = threading.Event()
    cancels = [start(queue, 1, seen, hold), start(queue, 2, seen)]
    threading.Timer(0.2, hold.set).start()
    queue.discard_pending()
    assert all(c.is_set() for c in cancels) and not queue.busy


@ONCE
def test_a_later_training_closes_the_earlier_one_on_its_directory():
    """Keras calls no on_train_end for a fit() that raised: the next
    training on the same directory lets its writes finish, then its lock go;
    a write of it that failed is a warning there, not this one's error."""
    where = directory()
    earlier = Training(CheckpointWriteError(28, "No space left on device"))
    first = SaveQueue(where, True, earlier)
    first.hold()
    later = Training()
    second = SaveQueue(where, True, later)
    with pytest.warns(UserWarning, match="earlier fit\\(\\) failed.*No space left"):
        second.hold()
    assert earlier.calls == ["wait", "unlock"] and later.calls == []
    assert holdings.get("writer", where) is second
    first.release()  # No longer the holder: changes nothing.
    assert holdings.get("writer", where) is second
    second.release()
    assert holdings.get("writer", where) is None


@ONCE
def test_a_later_training_waits_for_the_writes_of_one_that_is_gone():
    """The training of a fit() that raised may be collected before the next
    one starts; its queue, still the directory's holder, is waited for."""
    where = directory()
    first = SaveQueue(where, True, Training())
    first._training = lambda: None  # The training object is gone.
    holdings.put("writer", where, first)
    seen: list = []
    hold = threading.Event()
    start(first, 1, seen, hold)
    threading.Timer(0.3, hold.set).start()
    later = Training()
    second = SaveQueue(where, True, later)
    second.hold()
    assert [s for s, _, _ in seen] == [1]  # Committed before the hold.
    assert holdings.get("writer", where) is second
    second.release()


def test_a_training_collected_unreleased_ends_its_threads(tmp_path):
    """A training locked and never unlocked (its fit() raised and nothing
    followed on its directory) stays the directory's holder, but its helper
    threads end once it is garbage-collected (its finalizer never waits: it
    may run in any thread, at any allocation)."""
    state = keras_ft.WorkerTrainingState(make_model(), str(tmp_path))
    state.lock()
    state.back_up(1)
    state.wait()
    pools = state._state.pools
    used = [pools.hasher(), pools.syncer()]
    assert all(executor._threads for executor in used)
    del state
    gc.collect()
    assert pools.hasher._executor is None and pools.syncer._executor is None
    for thread in [t for executor in used for t in executor._threads]:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name


@ONCE
def test_a_training_collected_inside_a_submit_to_its_pools_closes_them_later():
    """A training may be collected in any thread at any allocation: in one
    of its writes, inside a submit to one of its own pools, which holds the
    lock that closing the pool takes. Its finalizer must not wait for that
    lock in the same thread (a CI run once hung there); the pools close once
    the submit is over."""
    holder = [Training()]
    queue = SaveQueue(directory(), True, holder[0])
    executor = queue.pools.syncer()

    def a_write_submitting():
        with executor._shutdown_lock:  # Held as `executor.submit()` holds it.
            holder.clear()  # The last reference: collected here, now.
            gc.collect()

    thread = threading.Thread(target=a_write_submitting, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the finalizer waited for its own thread's lock"
    deadline = time.monotonic() + 30
    while queue.pools.syncer._executor is not None:
        assert time.monotonic() < deadline, "the pools were never closed"
        time.sleep(0.01)
    executor.shutdown(wait=True)  # Its thread ends (closed without waiting).
