"""A worker's throwaway save: in a cluster, a process other than the chief
writes its save into a temporary directory of its own and removes it right
after (backends that need every worker to read distributed variables then
read them all), under a lock of its own."""

from __future__ import annotations

import functools
import os
import shutil

from keras_ft.checkpoint.lock import DirectoryLock
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute.cluster import TaskSpec, worker_temp_name
from keras_ft.saves import chief
from keras_ft.state import TrainingState


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
        self.path = backup.storage.scratch_dir(worker_temp_name(task.task_index))
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


class ThrowawaySaver:
    """Writes a worker's save into its scratch directory, then removes it.

    Args:
        state: The training state.
        scratch: The worker's directory.
    """

    def __init__(self, state: TrainingState, scratch: WorkerScratch):
        self._state, self._scratch = state, scratch

    def back_up(
        self, epochs_completed: int, batches_completed: int, extra: dict | None
    ) -> None:
        # Written right away, a snapshot can view the variables: no copy.
        snapshot = self._state.snapshot(
            epochs_completed, batches_completed, extra, copy=False
        )
        try:
            CheckpointStore(self._scratch.path).save(
                functools.partial(chief.write_snapshot, snapshot), snapshot.metadata
            )
        finally:
            shutil.rmtree(self._scratch.path, ignore_errors=True)
