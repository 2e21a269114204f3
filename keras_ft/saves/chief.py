"""The chief's save (with a local tier, every process's own): the state is
copied (on the device, or into the host buffer), then written and committed
by the writer thread while training goes on."""

from __future__ import annotations

import threading
from concurrent import futures

from keras_ft import threads
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.errors import (
    LeaseLapsedError,
    NonFiniteStateError,
    ProcessesDisagreeError,
)
from keras_ft.saves.queue import SaveQueue
from keras_ft.saves.save import Save, SaveFiles
from keras_ft.saves.throwaway import ScratchTier
from keras_ft.saves.tiers import TieredStore
from keras_ft.state import Snapshot
from keras_ft.state.snapshots import SnapshotPlace
from keras_ft.state.training_state import TrainingState, optimizer_step
from keras_ft.state.weights_copy import CapturedWeights
from keras_ft.training.listeners import CheckpointListener, notify


class ChiefSaver:
    """Saves of the whole state, taken and handed to the writer thread.

    Args:
        state: The training state.
        task: This process's role.
        queue: The training's saves in flight.
        tiers: Where they commit (a worker's `ScratchTier`: nowhere).
        lock: The backup's writer lock (a lapsed lease stops a commit).
        listeners: Told before a save and after its commit (on the chief).
        snapshots: Where a save copies the state (`snapshot=`).
    """

    def __init__(
        self,
        state: TrainingState,
        task: TaskSpec,
        queue: SaveQueue,
        tiers: TieredStore | ScratchTier,
        lock: object,
        listeners: list[CheckpointListener],
        snapshots: SnapshotPlace,
    ):
        self._state, self._task, self._queue, self._tiers = state, task, queue, tiers
        self._lock, self._listeners, self._snapshots = lock, listeners, snapshots
        self._moving: futures.Future | None = None  # The last snapshot's move.

    def before_save(self, epochs_completed: int) -> None:
        """Tells the listeners (on the chief) that a save begins."""
        if self._task.is_chief:
            step = optimizer_step(self._state.model)
            notify(self._listeners, "before_save", epochs_completed, step)

    def back_up(
        self,
        epochs_completed: int,
        batches_completed: int,
        extra: dict | None,
        replaces_last: bool,
        to_bucket: bool,
    ) -> Checkpoint | None:
        """`WorkerTrainingState.back_up()` of an unsharded model."""
        self.before_save(epochs_completed)
        # Another worker's local tier keeps its saves; only the chief uploads.
        to_bucket = to_bucket and self._task.is_chief
        # The copy goes into the one copy buffer once the save before has
        # written it out, and this save's write follows the copy, so the disk
        # never waits for all of it. In the background, the NaN/infinity
        # check follows the copy too (the write follows the check): training
        # then waits for the copy alone, and the writer refuses a non-finite
        # state before its commit.
        # On an accelerator, the copy training waits for is one on the device;
        # its move to host memory (and the check) follow in the background.
        snapshot = self._snapshot_to_write(epochs_completed, batches_completed, extra)
        try:
            cancel = self.start(snapshot, replaces_last, to_bucket=to_bucket)
        except BaseException:
            snapshot.release()  # Never written: the next copy must not wait.
            raise
        if snapshot.weights.from_device:
            move = threads.submit(
                self._queue.pools.mover, _move_to_host, snapshot.weights
            )
            self._moving = move
        else:
            snapshot.weights.fill()  # On failure, the write sees it and calls off.
        # Checked during the copy. A check that follows the copy is the
        # writer's to report, even if it is already over.
        if not snapshot.weights.checked_later and snapshot.weights.non_finite:
            cancel.set()  # The write stops where it is and commits nothing.
            raise NonFiniteStateError(snapshot.weights.non_finite)
        return self._queue.committed()

    def _snapshot_to_write(
        self, epochs_completed: int, batches_completed: int, extra: dict | None
    ) -> Snapshot:
        """The state now, for the writer to follow: copied on the device
        where saves snapshot there, else to be copied to host memory by
        `weights.fill()` before the next training step."""
        on_device = self._snapshots.on_device(self._state.saved_variables)
        if on_device and self._moving is not None:
            # One snapshot on the device at a time: the last one's move ends
            # (and frees it) before the next is made.
            self._moving.result()
            self._moving = None
        return self._state.snapshot(
            epochs_completed,
            batches_completed,
            extra,
            copy=True,
            fill=False,
            check_later=self._queue.async_save,  # A move's check always follows it.
            on_device=on_device,
            # Out of device memory: host memory from now on.
            device_failed=self._snapshots.out_of_memory,
        )

    def start(
        self,
        snapshot: Snapshot,
        replaces_last: bool,
        files: SaveFiles | None = None,
        to_bucket: bool = True,
        direct: bool = False,
    ) -> threading.Event:
        """Hands `snapshot`'s write (`files`, else its own files) and commit
        to the writer thread (`TieredStore.commit()` says what `to_bucket` and
        `direct` do).

        Returns:
            The event that calls this save off.
        """
        # A move to host memory stops with the save.
        stop = snapshot.weights.stop if snapshot.weights is not None else None
        save = Save(
            snapshot, files, to_bucket, direct, stop or threading.Event(),
            pools=self._queue.pools,
        )  # fmt: skip
        self._queue.start(self._commit, save, replaces_last)
        return save.cancel

    def _commit(self, save: Save) -> Checkpoint | None:
        """Runs in the writer thread: writes and commits one save."""
        snapshot = save.snapshot
        metadata = snapshot.metadata
        # A lapsed lease: another writer may commit.
        lock = self._lock if self._task.is_chief else None
        try:
            committed = self._tiers.commit(save, lock)
        except LeaseLapsedError:
            raise  # Says itself why nothing was committed.
        except (OSError, ProcessesDisagreeError) as e:
            raise self._tiers.write_failed(e) from e
        finally:
            snapshot.release()  # Also when it failed before writing anything.
        if committed is None:  # A worker's throwaway save.
            return None
        notify(
            self._listeners,
            "after_commit",
            committed.path,
            metadata["epochs_completed"],
            metadata["step"],
        )
        return committed


def _move_to_host(captured: CapturedWeights) -> None:
    """`captured.fill()` in a background thread: what fails there fails the
    save's write (no caller is left to raise it)."""
    try:
        captured.fill()
    except BaseException as e:
        captured.filled.fail(e)
