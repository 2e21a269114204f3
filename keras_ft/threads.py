"""Every background thread of keras-ft, and how far a buffer is ready.

Writers: one thread per save in flight (`BackgroundWriter`). Helpers, each a
small pool made on first use: checksums of pieces being written (2), fsyncs
of a checkpoint's files (4), verification of a checkpoint being read (1),
removal of deleted checkpoints (1), the second half of a snapshot's copy (1,
on a machine with more than one core). They are separate so that no kind of
work queues behind another: a write's checksum never waits for the previous
save's fsyncs.

The training thread hands over a write and goes on training. Writes overlap
by at most one stage: the next save's data may go to disk while the previous
save commits its small files, but commits happen in the order of the saves,
and a third save waits until the first is done, so memory stays bounded and
no save is skipped. A write's error is kept and raised in the training thread
the next time it looks: at the next batch end, the next save, or train end.
The threads are not daemons, so the interpreter waits for a pending commit
before it exits.

A `Watermark` tells one thread how much of a buffer another thread has made
ready: the writer follows the copy into the snapshot buffer piece by piece.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Cancelled(Exception):
    """Work called off before it was done: it has no result and no error.

    `keras_ft.errors.SaveCancelled` is the checkpoint's kind.
    """


class Watermark:
    """How many bytes from the start of a buffer are ready, across threads.

    Args:
        total: The buffer's size.
    """

    def __init__(self, total: int):
        self.total = total
        self._level = 0
        self._error: BaseException | None = None
        self._failed = False
        self._condition = threading.Condition()

    @property
    def level(self) -> int:
        return self._level

    def advance(self, level: int) -> None:
        """Marks the first `level` bytes ready."""
        with self._condition:
            if level > self._level:
                self._level = min(level, self.total)
                self._condition.notify_all()

    def finish(self) -> None:
        """Marks every byte ready."""
        self.advance(self.total)

    def abandon(self, error: BaseException) -> None:
        """The rest will never be ready: waiters get `Cancelled`."""
        with self._condition:
            self._error = error
            self._condition.notify_all()

    def fail(self, error: BaseException) -> None:
        """The rest will never be ready, and no one else reports why (it was
        being filled in a background thread): waiters get `error`."""
        with self._condition:
            self._error, self._failed = error, True
            self._condition.notify_all()

    def wait_for(self, level: int) -> None:
        """Waits until the first `level` bytes are ready.

        Raises:
            Cancelled: if they never will be (`abandon()`).
        """
        with self._condition:
            while self._level < min(level, self.total):
                if self._failed:
                    raise self._error
                if self._error is not None:
                    raise Cancelled(f"The snapshot was not taken ({self._error!r}).")
                self._condition.wait()


class PendingWrite:
    """`write(*args, previous)` in a thread of its own, `previous` being the
    write handed over before it (or `None`).

    A write that raises `Cancelled` was called off: it has no result
    and no error.
    """

    def __init__(
        self,
        write: Callable[..., Any],
        args: tuple = (),
        previous: PendingWrite | None = None,
    ):
        self._write, self._args, self._previous = write, args, previous
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="keras-ft-checkpoint-writer", daemon=False
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._write(*self._args, self._previous)
        except Cancelled:
            pass
        except BaseException as e:  # Handed to the training thread.
            self._error = e
        finally:
            # Not kept past the write: a chain of writes, each holding the
            # one before and its snapshot, would hold every save of a run.
            self._write, self._args, self._previous = None, (), None

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def value(self) -> Any:
        """The result of a write that has ended without an error, else `None`.

        Unlike `result()`, never waits and never raises.
        """
        if self._thread.is_alive() or self._error is not None:
            return None
        return self._result

    def join(self) -> None:
        """Waits for the write to end, whatever its outcome."""
        self._thread.join()

    def result(self) -> Any:
        """Waits for the write; returns its result or raises its error, once."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result


class BackgroundWriter:
    """Runs writes in background threads: at most two, committing in order.

    Args:
        depth: How many writes may be in flight at once. Defaults to `2`:
            one writing its data while the one before commits.
    """

    def __init__(self, depth: int = 2):
        self.depth = depth
        self._pending: list[PendingWrite] = []

    def submit(self, write: Callable[..., Any], *args: Any) -> PendingWrite:
        """Starts `write(*args, previous)`, `previous` being the write before
        it (a `PendingWrite`, or `None`).

        `write` should wait for `previous.join()` before it commits, so that
        commits keep the order of the saves. If `depth` writes are in flight,
        first waits for the oldest, raising its error.

        Returns:
            The write started.
        """
        while len(self._pending) >= self.depth:
            self._pending.pop(0).result()
        previous = self._pending[-1] if self._pending else None
        pending = PendingWrite(write, args, previous)
        self._pending.append(pending)
        return pending

    def wait(self) -> Any:
        """Waits for every write in flight; returns the newest's result.

        Raises:
            The first error among them, once all have ended.
        """
        pending, self._pending = self._pending, []
        result, first_error = None, None
        for write in pending:
            try:
                result = write.result()
            except BaseException as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return result

    @property
    def busy(self) -> bool:
        """Whether a write is still running."""
        return any(not write.done for write in self._pending)

    def raise_if_failed(self) -> None:
        """Raises the error of a write that has ended, without waiting."""
        while self._pending and self._pending[0].done:
            self._pending.pop(0).result()


def submit(
    executor: Callable[[], ThreadPoolExecutor], fn: Callable, *args, **kwargs
) -> Future:
    """`executor().submit(fn, ...)`, or `fn` run here once the interpreter exits.

    At exit, executors take no new work; a write still committing (which the
    interpreter waits for) then does the rest of it in its own thread.
    """
    try:
        return executor().submit(fn, *args, **kwargs)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:
            done.set_exception(e)
        return done


class _Pool:
    """A thread pool started on first use, closed by `close_pools()` once no
    training of the process needs it, and started again by the next one."""

    def __init__(self, workers: int, prefix: str, needs_two_cores: bool = False):
        self.workers, self.prefix = workers, prefix
        # Counted once: `os.cpu_count()` reads /sys at each call (20 us on
        # the VMs measured), and a copy asks at each of its batches.
        self._unwanted = needs_two_cores and (os.cpu_count() or 1) < 2
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor | None:
        if self._unwanted:
            return None
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.workers, thread_name_prefix=self.prefix
                )
            return self._executor

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


# The process's pools: shared by the saves of every training in it (a save
# reuses the threads of the one before), closed when the last training using
# them closes (`hold()` / `let_go()`; `saves/queue.py` holds them for a
# training, until it is released or collected); these and the writers of
# `saves/queue.py` are the only background work that outlives a save.
hasher = _Pool(2, "keras-ft-checksum")
syncer = _Pool(4, "keras-ft-fsync")
verifier = _Pool(1, "keras-ft-verify")
remover = _Pool(1, "keras-ft-remover")
# Uploads and downloads to object storage: the network, not the cores, is
# what they wait on.
transfer = _Pool(8, "keras-ft-transfer")
# A second thread for copies, on a machine with more than one core.
copy_helper = _Pool(1, "keras-ft-copy", needs_two_cores=True)
# The NaN/infinity check of a copy written in the background: off the
# training thread's time, ahead of the writer.
checker = _Pool(1, "keras-ft-finite-check")
# The move of a snapshot made on the device into host memory, beside the
# next training steps (the writer follows it).
mover = _Pool(1, "keras-ft-device-to-host")
_POOLS = (hasher, syncer, verifier, remover, transfer, copy_helper, checker, mover)
# How many trainings hold the pools: they outlive any one fit() (a save in
# flight), and the last training to let go shuts them down.
_holders = 0
_holders_lock = threading.Lock()
# Trainings garbage-collected while holding the pools, one entry each, added
# by their finalizers (`collected()`): a GC callback may run in any thread at
# any allocation, even one holding `_holders_lock` or an executor's lock, so
# it only appends; the next `hold()` or `let_go()` counts them.
_collected: list[None] = []


def _count_collected() -> None:
    """Takes the collected trainings off the count (`_holders_lock` held)."""
    global _holders
    while _collected:
        _collected.pop()
        _holders = max(0, _holders - 1)


def hold() -> None:
    """A training starts using the pools."""
    global _holders
    with _holders_lock:
        _count_collected()
        _holders += 1


def collected() -> None:
    """A training that held the pools was garbage-collected without letting
    go (a finalizer's call: never blocks, never takes a lock)."""
    _collected.append(None)


def holders() -> int:
    """How many trainings hold the pools now."""
    with _holders_lock:
        _count_collected()
        return _holders


def let_go() -> None:
    """A training is done with the pools; the last one closes them, once the
    directories it deleted are gone."""
    global _holders
    with _holders_lock:
        _count_collected()
        _holders = max(0, _holders - 1)
        last = _holders == 0
    if last:
        wait_for_removals()
        for pool in _POOLS:
            pool.close()


def start_daemon(target: Callable[[], Any], name: str) -> threading.Thread:
    """Runs `target` in a daemon thread (work nobody must wait for at exit)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def call_later(seconds: float, function: Callable[[], Any]) -> threading.Timer:
    """Calls `function` in a daemon thread after `seconds`, unless cancelled."""
    timer = threading.Timer(seconds, function)
    timer.daemon = True
    timer.start()
    return timer


# Deleted checkpoints are removed by one thread; a kill leaves them as
# `.trash-*` directories, which the store clears at the next start.
_removals: set[Future] = set()
_removals_lock = threading.Lock()


def remove_in_background(path: str) -> None:
    """Removes the directory `path` in the remover's thread."""
    with _removals_lock:
        future = submit(remover, shutil.rmtree, path, ignore_errors=True)
        _removals.add(future)
    future.add_done_callback(_forget_removal)


def _forget_removal(future: Future) -> None:
    with _removals_lock:
        _removals.discard(future)


# A finished backup's checkpoints, moved out of `backup_dir` in one rename
# each and removed in a thread of their own: fit()'s end does not wait for
# the disk; the interpreter does, at exit (the threads are not daemons).
_discards: dict[threading.Thread, str] = {}


def remove_later(path: str) -> None:
    """Removes the directory `path` in a thread nobody in `fit()` waits for."""
    thread = threading.Thread(
        target=_discard, args=(path,), name="keras-ft-discard", daemon=False
    )
    with _removals_lock:
        _discards[thread] = path
    thread.start()


def _discard(path: str) -> None:
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        with _removals_lock:
            _discards.pop(threading.current_thread(), None)


def pending_removals() -> set[str]:
    """The directories `remove_later()` is removing now, in this process."""
    with _removals_lock:
        return set(_discards.values())


def wait_for_discards() -> None:
    """Waits until the directories `remove_later()` was given are gone."""
    with _removals_lock:
        pending = list(_discards)
    for thread in pending:
        thread.join()


def wait_for_removals() -> None:
    """Waits until the directories removed so far are gone from disk."""
    with _removals_lock:
        pending = list(_removals)
    for future in pending:
        future.result()
