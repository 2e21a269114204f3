"""A worker's throwaway save: in a cluster, a process other than the chief
writes its save into a temporary directory of its own and removes it right
after (backends that need every worker to read distributed variables then
read them all), under a lock of its own. It is taken and written as the
chief's save is, in the background."""

from __future__ import annotations

import os
import shutil

from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.lock import DirectoryLock
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute.cluster import TaskSpec, worker_temp_name
from keras_ft.saves.chief import ChiefSaver
from keras_ft.saves.queue import SaveQueue
from keras_ft.saves.save import Save
from keras_ft.saves.tiers import TieredStore
from keras_ft.state import TrainingState
from keras_ft.state.snapshots import SnapshotPlace
from keras_ft.threads import PendingWrite


class WorkerScratch:
    """A worker's temporary directory and its lock.

    The lock lies beside the directory: a second cluster's worker on the
    same `backup_dir` must not empty it in the middle of this one's save.

    Args:
        backup: The chief's store (it says where scratch directories go:
            beside the chief's directory on a disk, a local directory for
            a bucket).
        task: This worker's role.
        backup_dir: The backup's directory, for messages.
    """

    def __init__(self, backup: CheckpointStore, task: TaskSpec, backup_dir: str):
        scratch = backup.storage.housekeeping.scratch_dir
        self.path = scratch(worker_temp_name(task.task_index))
        self._lock = DirectoryLock(
            # `backup_dir` may be a link the user made; the lock file not.
            os.path.realpath(os.path.dirname(self.path)),
            os.path.basename(self.path) + ".lock",
            f"Worker {task.task_index}'s directory {self.path!r} for "
            f"backup_dir={backup_dir!r}",
        )

    def acquire(self) -> None:
        """Locks the directory and empties it: it only ever holds the save
        being written."""
        self._lock.acquire()
        shutil.rmtree(self.path, ignore_errors=True)

    def release(self) -> None:
        self._lock.release(remove=True)  # Beside the backup: leave no trace.

    def delete(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def check_writable(self) -> None:
        CheckpointStore(self.path).check_writable()


class ThrowawaySaver(ChiefSaver):
    """Writes a worker's save into its scratch directory, then removes it.

    The save is taken as the chief takes its own (a copy on the device, or
    into the host buffer, with `snapshot=`), and written by the writer
    thread: a worker holds the cluster's next step up no longer than the
    chief does.

    Args:
        state: The training state.
        task: This worker's role.
        queue: The training's saves in flight.
        tiers: The backup's stores (for the error of a failed write).
        scratch: The worker's directory.
        snapshots: Where a save copies the state (`snapshot=`).
    """

    def __init__(
        self,
        state: TrainingState,
        task: TaskSpec,
        queue: SaveQueue,
        tiers: TieredStore,
        scratch: WorkerScratch,
        snapshots: SnapshotPlace,
    ):
        super().__init__(state, task, queue, tiers, None, [], snapshots)
        self._scratch = scratch

    def _commit(self, save: Save, previous: PendingWrite | None) -> None:
        """Runs in the writer thread: writes one save's files into the
        scratch directory and removes them. Nothing reads them, so nothing
        is made durable (no fsync) or committed."""
        try:
            if previous is not None:
                previous.join()  # The directory holds one save at a time.
            try:
                os.makedirs(self._scratch.path, exist_ok=True)
                save.write_files(
                    Staging(self._scratch.path, save.cancel, sync=False,
                            pools=save.pools)
                )  # fmt: skip
            except OSError as e:
                raise self._tiers.write_failed(e) from e
            finally:
                shutil.rmtree(self._scratch.path, ignore_errors=True)
        finally:
            save.snapshot.release()  # Also when it failed before writing anything.
