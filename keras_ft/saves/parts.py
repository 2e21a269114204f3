"""What a `WorkerTrainingState` is made of, put together in one place.

The facade (`worker_training_state.py`) decides nothing about how a save is
made; these objects do, each with one job: the backup's store and its lock,
the tiers a save commits to, the queue of saves in flight, who holds the
backup (the chief, or a worker's scratch directory), and a saver per kind of
save (the chief's, a process's shards, a worker's throwaway save).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from keras_ft.checkpoint.format import chief_directory
from keras_ft.checkpoint.store import CheckpointStore, Storage, open_storage, open_store
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.options import BackupOptions
from keras_ft.saves.chief import ChiefSaver
from keras_ft.saves.claims import ChiefClaim
from keras_ft.saves.queue import SaveQueue
from keras_ft.saves.shards import ShardedSaver
from keras_ft.saves.throwaway import ScratchTier, WorkerScratch
from keras_ft.saves.tiers import TieredStore
from keras_ft.state import TrainingState
from keras_ft.state.snapshots import SnapshotPlace
from keras_ft.training.listeners import CheckpointListener
from keras_ft.training.policy import KeepLast


@dataclasses.dataclass
class SaveParts:
    store: CheckpointStore  # The chief's checkpoints: a disk or a bucket.
    root: Storage  # `backup_dir` itself.
    lock: Any  # The backup's writer lock (a file lock, or a bucket's lease).
    tiers: TieredStore
    queue: SaveQueue
    claim: ChiefClaim | WorkerScratch
    chief: ChiefSaver
    sharded: ShardedSaver
    # A worker's save without a local tier: written, then removed.
    throwaway: ChiefSaver | None


def assemble(
    training: Any,
    state: TrainingState,
    task: TaskSpec,
    options: BackupOptions,
    listeners: list[CheckpointListener],
) -> SaveParts:
    """The parts of `training` (a `WorkerTrainingState`); its writer (the
    queue) closes the state's helper threads once its writes are over."""
    # A disk (rename commit, flock) or a bucket (manifest-last commit,
    # lease): one protocol, and nothing here asks which.
    backup_dir, keep = options.backup_dir, options.keep
    store = open_store(
        chief_directory(backup_dir),
        KeepLast(keep),
        options.storage_options,
        progress=sys.stdout if options.verbose else None,
        manifest_key=options.manifest_key,
    )
    root = open_storage(backup_dir, options.storage_options)
    lock = store.writer_lock()
    tiers = TieredStore.open(
        store, lock, root, options.local_dir, keep, task, state, options.manifest_key
    )
    queue = SaveQueue(store.identity, options.async_save, training, state.pools)
    snapshots = SnapshotPlace(options.snapshot)
    # The chief holds the backup's lock; another worker only the temporary
    # directory its throwaway saves go to.
    scratch = None if task.is_chief else WorkerScratch(store, task, backup_dir)
    chief = ChiefSaver(state, task, queue, tiers, lock, listeners, snapshots)
    return SaveParts(
        store=store,
        root=root,
        lock=lock,
        tiers=tiers,
        queue=queue,
        claim=scratch or ChiefClaim(store, lock, root),
        chief=chief,
        sharded=ShardedSaver(state, task, queue, tiers, chief, snapshots),
        throwaway=(
            ChiefSaver(
                state, task, queue, ScratchTier(scratch, tiers), None, [], snapshots
            )
            if scratch is not None and tiers.local is None
            else None
        ),
    )
