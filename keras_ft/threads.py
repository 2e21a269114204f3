"""Every background thread of keras-ft, and how far a buffer is ready.

A training's `Pools`, each made on first use and closed by the training's
writer once its writes are over: the writes (one thread, `BackgroundWriter`)
and their helpers (checksums, fsyncs, the copy's second half, the check, the
move from the device); a thread per verification and per transfer batch of a
restore or an upload (`in_thread()`, a `Pool` of the call's own); a thread
per directory removed (`remove_in_background()`).

The training thread hands over a write and goes on training. Writes run one
at a time, in the order of the saves, so commits keep that order; a save
handed over while one write runs and another waits first waits for the
running one, so memory stays bounded and no save is skipped. A write's error
is kept and raised in the training thread the next time it looks: at the
next batch end, the next save, or train end. The interpreter waits for a
pending commit before it exits (a pool's threads finish the work handed to
them; the others are not daemons).

A `Watermark` tells one thread how much of a buffer another thread has made
ready: the writer follows the copy into the snapshot buffer piece by piece.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from keras_ft import holdings


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
    """`write(*args)` in `pool`'s thread.

    A write that raises `Cancelled` was called off: it has no result
    and no error.
    """

    def __init__(
        self,
        write: Callable[..., Any],
        args: tuple,
        pool: Pool,
    ):
        self._write, self._args = write, args
        self._future = submit(pool, self._run)

    def _run(self) -> Any:
        try:
            return self._write(*self._args)
        except Cancelled:
            return None
        finally:
            # Not kept past the write: its snapshot is let go with it.
            self._write, self._args = None, ()

    @property
    def done(self) -> bool:
        return self._future.done()

    @property
    def value(self) -> Any:
        """The result of a write that has ended without an error, else `None`.

        Unlike `result()`, never waits and never raises.
        """
        future = self._future
        if not future.done() or future.exception() is not None:
            return None
        return future.result()

    def join(self) -> None:
        """Waits for the write to end, whatever its outcome."""
        wait([self._future])

    def result(self) -> Any:
        """Waits for the write; returns its result or raises its error, once."""
        future = self._future
        error = future.exception()  # Waits.
        if error is None:
            return future.result()
        self._future = _ENDED  # Raised once: later, no result and no error.
        raise error


# A write's outcome once its error was raised: no result and no error.
_ENDED: Future = Future()
_ENDED.set_result(None)


class BackgroundWriter:
    """Runs writes in a background thread, one at a time, in order.

    Args:
        pool: A pool of one thread that runs the writes (a training's
            `Pools.writer`, closed with its other helpers): its order is
            the commits'. Defaults to `None`: a thread of the writer's own,
            which `close()` ends.
    """

    # Writes in flight at most: one running, one waiting for it.
    depth = 2

    def __init__(self, pool: Pool | None = None):
        self._pool = pool or Pool(1, "keras-ft-checkpoint-writer")
        if self._pool.workers != 1:
            raise ValueError(
                "Invalid value for argument `pool`. Expected a pool of one "
                f"thread (writes commit in order). Received: {self._pool.workers} "
                "workers"
            )
        self._pending: list[PendingWrite] = []

    def submit(self, write: Callable[..., Any], *args: Any) -> PendingWrite:
        """Starts `write(*args)` once the writes handed over before it have
        ended. If `depth` writes are in flight, first waits for the oldest,
        raising its error.

        Returns:
            The write started.
        """
        while len(self._pending) >= self.depth:
            self._pending.pop(0).result()
        pending = PendingWrite(write, args, self._pool)
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

    def close(self) -> None:
        """Waits for every write in flight (raising the first error, as
        `wait()`), then ends the threads; a later write starts them again."""
        try:
            self.wait()
        finally:
            self._pool.close()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def submit(pool: Pool | None, fn: Callable, *args, **kwargs) -> Future:
    """`fn(...)` in one of `pool`'s threads, or here: without a pool, or once
    the interpreter exits.

    At exit, executors take no new work; a write still committing (which the
    interpreter waits for) then does the rest of it in its own thread.
    """
    if pool is not None:
        with contextlib.suppress(RuntimeError):
            executor = pool()
            if executor is not None:
                return executor.submit(fn, *args, **kwargs)
    done: Future = Future()
    _settle(done, fn, args, kwargs)
    return done


# Threads of one batch of uploads or downloads: the network, not the cores,
# is what they wait on.
TRANSFERS = 8


class Pool:
    """A thread pool started on first use, closed by `close()` (its owner's),
    and started again if used after that.

    Args:
        workers: How many threads it has at most.
        prefix: Their names' start.
        needs_two_cores: Whether it is worth a thread only on a machine with
            more than one core (else it gives no executor: the work is done
            by the caller).
    """

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

    def close(self, wait: bool = True) -> None:
        """Ends the threads once their work is done. With `wait`, calls off
        the work not begun and waits for the rest; without, returns at once
        and lets the work handed over run (a finalizer's call)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=wait)


class Pools:
    """The helper threads of one training's saves, each pool started on
    first use; `close()` ends them (its writer's, once its writes are over).

    They are separate so that no kind of work queues behind another: a
    write's checksum never waits for the previous save's fsyncs.
    """

    def __init__(self) -> None:
        # Checksums of the pieces being written.
        self.hasher = Pool(2, "keras-ft-checksum")
        # fsyncs of a checkpoint's files, together.
        self.syncer = Pool(4, "keras-ft-fsync")
        # The second half of a snapshot's copy, on more than one core: the
        # training thread waits for the copy (held up 10 % less on
        # TensorFlow, docs/benchmarks.md).
        self.copy_helper = Pool(1, "keras-ft-copy", needs_two_cores=True)
        # The NaN/infinity check of a copy, ahead of the writer.
        self.checker = Pool(1, "keras-ft-finite-check")
        # The move of a snapshot made on the device into host memory,
        # beside the next training steps (the writer follows it).
        self.mover = Pool(1, "keras-ft-device-to-host")
        # The writes themselves (`BackgroundWriter`), one at a time: a
        # second writer, writing a save's data while the one before
        # commits, did not pay (docs/benchmarks.md). Started once, not per
        # save: a new thread cost the training thread about 1 ms a save
        # under load.
        self.writer = Pool(1, "keras-ft-checkpoint-writer")

    def close(self, wait: bool = True) -> None:
        """Ends the threads (see `Pool.close()`)."""
        for pool in (self.hasher, self.syncer, self.copy_helper, self.checker,
                     self.mover, self.writer):  # fmt: skip
            pool.close(wait)


def close_soon(pools: Pools) -> None:
    """`pools.close(wait=False)` in a thread of its own, for a finalizer.

    A finalizer runs in whatever thread the garbage collector interrupts, at
    any allocation: maybe inside a submit to one of these pools, holding the
    executor's lock that closing it takes (it would wait for itself forever).
    Another thread waits for that submit to end instead.
    """
    # At exit no thread starts (RuntimeError): the interpreter ends the pools'.
    with contextlib.suppress(RuntimeError):
        start_daemon(pools.close, "keras-ft-closer", False)


def start_daemon(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Runs `target(*args)` in a daemon thread (work nobody must wait for at
    exit)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def call_later(seconds: float, function: Callable[[], Any]) -> threading.Timer:
    """Calls `function` in a daemon thread after `seconds`, unless cancelled."""
    timer = threading.Timer(seconds, function)
    timer.daemon = True
    timer.start()
    return timer


def in_thread(fn: Callable, *args: Any, name: str) -> Future:
    """`fn(*args)` in a thread of its own (not a daemon), or here once the
    interpreter exits; its result or error in the future returned."""
    done: Future = Future()
    try:
        threading.Thread(
            target=_settle, args=(done, fn, args), name=name, daemon=False
        ).start()
    except RuntimeError:  # At exit: no new thread.
        _settle(done, fn, args)
    return done


def _settle(
    done: Future, fn: Callable, args: tuple, kwargs: dict | None = None
) -> None:
    try:
        done.set_result(fn(*args, **(kwargs or {})))
    except BaseException as e:
        done.set_exception(e)


def remove_in_background(path: str, discard: bool = False) -> None:
    """Removes the directory `path` in a thread nobody in `fit()` waits for:
    a deleted checkpoint, or with `discard` a finished backup's checkpoints
    (`wait_for_discards()`).

    fit() and a save never wait for the disk; the interpreter does, at exit
    (the threads are not daemons). The removal outlives the fit() that began
    it, so this process holds it (`holdings`); a kill leaves `.trash-*`
    entries that the store clears at its next start.
    """
    name = "keras-ft-discard" if discard else "keras-ft-remover"
    listed = threading.Event()
    thread = threading.Thread(
        target=_remove, args=(path, listed), name=name, daemon=False
    )
    try:
        thread.start()
    except RuntimeError:  # At exit: no new thread.
        shutil.rmtree(path, ignore_errors=True)
        return
    holdings.put("removal", path, (thread, discard))
    listed.set()


def _remove(path: str, listed: threading.Event) -> None:
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        listed.wait()  # Listed once started, so that it is let go after.
        entry = holdings.get("removal", path)
        if entry is not None and entry[0] is threading.current_thread():
            holdings.pop("removal", path, entry)


def pending_removals() -> set[str]:
    """The finished backups' directories being removed now, in this process."""
    return {p for p, (_, discard) in holdings.of_kind("removal").items() if discard}


def _wait(discards: bool) -> None:
    for thread, discard in holdings.of_kind("removal").values():
        if discard == discards:
            thread.join()


def wait_for_discards() -> None:
    """Waits until the finished backups' directories are gone."""
    _wait(discards=True)


def wait_for_removals() -> None:
    """Waits until the checkpoints deleted so far are gone from disk."""
    _wait(discards=False)
