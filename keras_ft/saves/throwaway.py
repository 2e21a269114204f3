"""A worker's throwaway save: in a cluster, a process other than the chief
writes its save into a temporary directory of its own and removes it right
after (backends that need every worker to read distributed variables then
read them all), under a lock of its own. It is the chief's save (taken and
written in the background by the same `ChiefSaver`) into another tier:
`ScratchTier`, which commits nothing."""

from __future__ import annotations

import os
import shutil
from typing import Any

from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.lock import DirectoryLock
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute.cluster import TaskSpec, worker_temp_name
from keras_ft.errors import ProcessesDisagreeError
from keras_ft.saves.save import Save
from keras_ft.saves.tiers import TieredStore


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


class ScratchTier:
    """Where a worker's save goes: written into its scratch directory, then
    removed. Nothing reads it, so nothing is made durable (no fsync) or
    committed: `commit()` returns `None`.

    Args:
        scratch: The worker's directory.
        tiers: The backup's stores (for the error of a failed write).
    """

    def __init__(self, scratch: WorkerScratch, tiers: TieredStore):
        self._scratch, self._tiers = scratch, tiers

    def commit(self, save: Save, lock: Any) -> None:
        """Runs in the writer thread: writes one save's files into the
        scratch directory (one save at a time, as the writer runs them), and
        removes them."""
        try:
            os.makedirs(self._scratch.path, exist_ok=True)
            save.write_files(
                Staging(self._scratch.path, save.cancel, sync=False, pools=save.pools)
            )
        finally:
            shutil.rmtree(self._scratch.path, ignore_errors=True)

    def write_failed(self, error: OSError | ProcessesDisagreeError) -> Exception:
        return self._tiers.write_failed(error)
