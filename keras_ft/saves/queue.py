"""One training's saves in flight, on the training's own writer.

Each training has its writer; a training lets go of its directory
(`release()`) only once its writes are over, so that nothing of it commits
after another training took the directory. A `fit()` that raised is never
released by Keras (no `on_train_end`): the next training of the process on
the same directory finds it as the directory's holder, waits for its writes
and releases it (`hold()`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from keras_ft import events, holdings, threads
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.errors import CheckpointWriteError, NonFiniteStateError
from keras_ft.threads import (
    BackgroundWriter,
    PendingWrite,
    wait_for_discards,
    wait_for_removals,
)

# A commit handed to the writer: `commit(save)`, with the save (a
# `saves.chief.Save`: its `cancel` event calls it off, its `replaced` is the
# write it supersedes). The writer runs one at a time, in order.
Commit = Callable[[Any], Any]


def wait_for_backups() -> None:
    """Waits until every backup being written in the background is committed,
    and a finished fit()'s checkpoints are removed from disk.

    `fit()` waits for its writes by itself at train end; call this after
    `fit()` raised, to look at the backup directory, or before copying it
    elsewhere. A finished fit()'s checkpoints leave `backup_dir` before it
    returns, but are removed in the background: call this before measuring
    the disk, or before removing a directory that holds `backup_dir` when
    that is on another filesystem than the temporary directory (there they
    wait beside `backup_dir`, in `.<name>.keras-ft-deleted-*`).

    Raises:
        keras_ft.CheckpointWriteError: if one of those writes failed.
    """
    for queue in holdings.of_kind("writer").values():
        queue.wait()
    wait_for_removals()
    wait_for_discards()


class SaveQueue:
    """A training's saves in flight, on a writer of its own.

    Args:
        identity: The chief store's identity (its directory or URL).
        async_save: Whether a save returns before its commit (see
            `WorkerTrainingState`).
        training: The training it belongs to: `hold()` closes an earlier
            training on the same directory that was never closed.
        pools: The training's writer and helper threads, closed by `release()`.
            Defaults to `None`: threads of its own.
    """

    def __init__(
        self,
        identity: str,
        async_save: bool,
        training: Any,
        pools: threads.Pools | None = None,
    ):
        self.identity, self.async_save = identity, async_save
        self._training = weakref.ref(training)
        self.pools = pools = pools or threads.Pools()
        # A training collected unreleased (a fit() that raised, and no later
        # training on its directory) ends its threads; the queue may be kept
        # as the directory's holder. The finalizer may run in any thread, at
        # any allocation: in one of its writes, inside a submit to these very
        # pools, holding the lock that closing them takes (`close_soon()`).
        weakref.finalize(training, threads.close_soon, pools)
        self._writer = BackgroundWriter(pools.writer)
        self._cancels: list[threading.Event] = []  # Of the saves in flight.
        # The newest save, for a save that replaces it.
        self._last: tuple[threading.Event, PendingWrite] | None = None

    def start(self, commit: Commit, save: Any, replaces_last: bool) -> None:
        """Hands `commit(save)` to the writer thread; with
        `replaces_last`, calls the last save off first and sets it as
        `save.replaced`."""
        cancel = save.cancel
        if replaces_last and self._last:
            cancel_last, save.replaced = self._last
            cancel_last.set()  # Before this copy waits for its write to end.
        pending = self._writer.submit(commit, save)
        self._last = (cancel, pending)
        self._cancels.append(cancel)
        # Only the newest `depth` saves can still be in flight (`submit()`
        # waited for the others): a long run keeps no more events than that.
        del self._cancels[: -self._writer.depth]

    def run(self, write: Callable[..., Any], *args: Any) -> None:
        """Hands `write(*args)`, which commits nothing, to the
        writer thread; waits for it unless saves are asynchronous."""
        self._writer.submit(write, *args)
        if not self.async_save:
            self._writer.wait()

    def committed(self) -> Checkpoint | None:
        """What a save returns: `None` if asynchronous, else its commit."""
        if self.async_save:
            return None
        self._cancels = []
        return self._writer.wait()

    def wait(self) -> Checkpoint | None:
        """Waits for every save in flight; returns the newest's commit."""
        self._cancels = []
        return self._writer.wait()

    def finish(self) -> None:
        """Waits for the writes in flight, where their error is no longer
        the caller's to raise (a restore about to read the newest commit, a
        training letting go of its directory): a failed one is a warning."""
        try:
            self._writer.wait()
        except (CheckpointWriteError, NonFiniteStateError) as e:
            events.warn("save", f"A backup being written failed: {e}", stacklevel=3)

    def discard_pending(self) -> None:
        """Calls off the saves that have not committed yet (see
        `WorkerTrainingState.discard_pending()`)."""
        for cancel in self._cancels:
            cancel.set()
        self._cancels = []
        self._writer.wait()  # Called-off writes end without an error.

    @property
    def busy(self) -> bool:
        return self._writer.busy

    def raise_if_failed(self) -> None:
        self._writer.raise_if_failed()

    def hold(self) -> None:
        """Makes this training the directory's holder, closing an earlier
        one that was not closed (its writes commit, then its lock and its
        threads go)."""
        # Keras calls no `on_train_end` for a fit() that raised: its writer
        # stays the directory's (even with its training gone) until this one
        # has waited for its writes and closed it.
        earlier = holdings.get("writer", self.identity)
        if earlier is not None and earlier is not self:
            # A fit() that raised (its training may be gone): its writes
            # commit first, and it lets go.
            training = earlier._training()
            try:
                (training or earlier).wait()
            except (CheckpointWriteError, NonFiniteStateError) as e:
                events.warn(
                    "save", f"A backup from an earlier fit() failed: {e}", stacklevel=4
                )
            finally:
                if training is not None:
                    training.unlock()
                earlier.release()
        holdings.put("writer", self.identity, self)

    def release(self) -> None:
        """Gives up the holder's place and ends the training's helper
        threads (a later save starts them again). Call once its writes are
        over (`finish()`)."""
        holdings.pop("writer", self.identity, self)
        self.pools.close()
