"""Who holds a backup, by role: the chief holds the backup's writer lock (a
`flock` on a disk, a lease in a bucket); another worker holds only its own
temporary directory (`throwaway.WorkerScratch`, the same interface)."""

from __future__ import annotations

from typing import Any

from keras_ft import events
from keras_ft.checkpoint.local import sweep_discarded
from keras_ft.checkpoint.store import CheckpointStore, Storage


class ChiefClaim:
    """The chief's hold on the backup in `store`.

    Args:
        store: The chief's checkpoints.
        lock: `store`'s writer lock.
        root: The storage of `backup_dir` itself.
    """

    def __init__(self, store: CheckpointStore, lock: Any, root: Storage):
        self._store, self._lock, self._root = store, lock, root

    def check_writable(self) -> None:
        self._store.check_writable()

    def acquire(self) -> None:
        """Locks the backup, then removes what a killed writer left there
        (staging directories, partial uploads, pieces of sharded saves)."""
        self._lock.acquire()
        self._store.remove_leftovers()
        sweep_discarded(self._root.location)  # A finished run's, if killed.

    def release(self) -> None:
        self._lock.release()

    def delete(self) -> None:
        """Deletes the checkpoints (a failure is a warning: training is
        over) and the lock."""
        try:
            self._store.clear(beside=self._root.location)
        except Exception as e:  # A bucket out of reach: say so, go on.
            events.warn(
                "save",
                f"keras-ft: fit() is over, but its backup in "
                f"{self._store.directory} could not be deleted "
                f"({type(e).__name__}: {e}). Delete it yourself, or "
                "`keras-ft prune` it.",
                stacklevel=4,
            )
        self._lock.release(remove=True)
        self._store.storage.housekeeping.remove_root()  # Emptied of its lock file.
