"""Where a save commits and a restore reads: the backup's store alone, or,
with `local_dir`, this machine's disk first and a copy in the bucket.

The local tier's restore decisions are `LocalTier`'s (`keras_ft/local_tier.py`);
its commits, locks and clean-up are here, so that a saver commits into
"the tiers" without asking whether there is one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keras_ft import events, threads
from keras_ft.backend import cross_process
from keras_ft.checkpoint.files import ReadProgress, Staging
from keras_ft.checkpoint.format import METADATA_FILE, Checkpoint
from keras_ft.checkpoint.store import CheckpointStore, open_store
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.errors import CheckpointWriteError, ProcessesDisagreeError
from keras_ft.local_tier import LocalTier
from keras_ft.saves.save import Save
from keras_ft.state import ResumePoint, TrainingState
from keras_ft.training.policy import KeepLast

if TYPE_CHECKING:  # fsspec is optional.
    from keras_ft.checkpoint.remote import ObjectStorage

# How many of the newest saves' local checkpoints are remembered by their
# bucket copies (only the newest are asked for, by a save replacing one).
_REMEMBERED = 8


class TieredStore:
    """The chief's store (`backup`), and a local tier in front of it or not.

    Args:
        backup: The backup's store (a directory or a bucket).
        lock: `backup`'s writer lock (checked before a commit there).
        local: The local tier's store, or `None`.
        tier: Its restore decisions (`LocalTier`), with `local`.
    """

    def __init__(
        self,
        backup: CheckpointStore,
        lock: Any,
        local: CheckpointStore | None = None,
        tier: LocalTier | None = None,
    ):
        self.backup, self.local, self.tier = backup, local, tier
        self._lock = lock
        self._local_lock = local.writer_lock() if local is not None else None
        # A save's local checkpoint, by the bucket copy made of it.
        self._copies: dict[str, Checkpoint] = {}

    @classmethod
    def open(
        cls,
        backup: CheckpointStore,
        lock: Any,
        root: ObjectStorage,
        local_dir: str | None,
        keep: int,
        task: TaskSpec,
        state: TrainingState,
        manifest_key: str | bytes | None,
    ) -> TieredStore:
        """The tiers of a backup in `backup`, with a local tier in
        `local_dir` (a directory named after the bucket `root`) or none."""
        if local_dir is None:
            return cls(backup, lock)
        # In a cluster, a kill leaves the processes' newest saves a few
        # apart: each keeps enough for a step they all hold.
        spread = 4 if task.num_workers > 1 else 1
        local = open_store(
            local_tier_dir(local_dir, root, task),
            KeepLast(max(keep, spread)),
            manifest_key=manifest_key,
        )
        # A model split across processes: each tier holds every piece its
        # process holds, to rebuild that process's slices alone.
        state.every_replica = True
        return cls(backup, lock, local, LocalTier(local, backup, task, state))

    def lock(self, task: TaskSpec, model: Any, local_dir: str | None) -> None:
        """Claims the local tier (if any) for this process, after checking
        that the processes can agree on it, and removes what a killed writer
        left there."""
        if self.local is None:
            return
        if task.num_workers > 1:
            with cross_process.collectives_scope(model):
                agree = cross_process.gathers_across_processes()
            if not agree:
                raise ValueError(
                    "Invalid value for argument `local_dir`: in a run of "
                    f"{task.num_workers} processes, the processes agree on which "
                    "tier to restore from before any of them loads, through a "
                    "JAX cluster, a `tf.distribute.MultiWorkerMirroredStrategy` "
                    "(the model's) or an initialised `torch.distributed` group, "
                    "and this run has none of them. Build the model under such a "
                    "strategy, or pass local_dir=None. Received: "
                    f"local_dir={local_dir!r}"
                )
        self._local_lock.acquire()
        self.local.remove_leftovers()

    def unlock(self) -> None:
        if self._local_lock is not None:
            self._local_lock.release()

    def clear_local(self) -> None:
        """Deletes the local tier (every process's own)."""
        if self.local is not None:
            self.local.clear()
            self._local_lock.release(remove=True)
            self.local.storage.housekeeping.remove_root()

    def commit(self, save: Save, lock: Any) -> Checkpoint:
        """Writes and commits one save (in the writer thread): into the
        local tier first if there is one (then, `save.to_bucket`, a copy
        into the bucket), else, or with `save.direct` (a sharded save's own
        commit into the bucket), into the backup's store. Each commit checks
        `lock` (if any) before it takes a number;
        the checkpoint of the save `save` supersedes is deleted once it is
        committed."""
        replaced = save.superseded()
        metadata, cancel = save.snapshot.metadata, save.cancel
        if self.local is None or save.direct:
            return self._to_bucket(
                save.write_files,
                metadata,
                cancel,
                lock,
                self._committed_in(replaced, "bucket"),
                save.pools,
            )
        committed = self.local.save(
            save.write_files,
            metadata,
            cancel,
            lock=lock,
            supersedes=self._committed_in(replaced, "local"),
            pools=save.pools,
        )
        if not save.to_bucket:
            return committed
        local = committed
        committed = self._to_bucket(
            TierCopy(self.local, local).write,
            metadata,
            cancel,
            self._lock,
            self._committed_in(replaced, "bucket"),
            save.pools,
        )
        self._copies[committed.path] = local
        while len(self._copies) > _REMEMBERED:
            del self._copies[next(iter(self._copies))]
        return committed

    def _to_bucket(
        self,
        write: Callable[[Staging], None],
        metadata: dict,
        cancel: Any,
        lock: Any,
        supersedes: Checkpoint | None,
        pools: threads.Pools | None,
    ) -> Checkpoint:
        """Commits one save into the backup's store; with a local tier, the
        tier's note says which checkpoint that is from right before the
        commit (`LocalTier.uploading()`)."""
        if self.tier is None:
            return self.backup.save(
                write, metadata, cancel, lock=lock, supersedes=supersedes,
                pools=pools,
            )  # fmt: skip
        try:
            committed = self.backup.save(
                write,
                metadata,
                cancel,
                lock=lock,
                supersedes=supersedes,
                committing=self.tier.uploading,
                pools=pools,
            )
        except BaseException:
            self.tier.upload_failed()
            raise
        self.tier.uploaded(committed, metadata)
        return committed

    def _committed_in(
        self, checkpoint: Checkpoint | None, tier: str
    ) -> Checkpoint | None:
        """`checkpoint` (a save's result) as committed in `tier` ("local" or
        "bucket"), or `None` if that save did not go there."""
        if checkpoint is None or self.local is None:
            return checkpoint
        local = self._copies.get(checkpoint.path)
        if tier == "local":
            return local if local is not None else checkpoint
        return checkpoint if local is not None else None

    def write_failed(self, error: OSError | ProcessesDisagreeError) -> Exception:
        """The error a failed save raises: what is intact, and the fix."""
        try:
            committed = self.backup.checkpoints()
        except Exception:  # A bucket out of reach cannot be listed either.
            committed = None
        if committed is None:
            previous = "the checkpoints committed before are intact"
        elif committed:
            previous = f"the previous checkpoint {committed[-1].name} is intact"
        else:
            previous = "no checkpoint had been committed yet"
        if isinstance(error, ProcessesDisagreeError):
            fix = (
                "Relaunch every process of the training together, with the "
                "same script and arguments"
            )
        else:
            fix = self.backup.write_error_fix
        return CheckpointWriteError(
            # Processes that disagree raise no OSError: no errno.
            getattr(error, "errno", None),
            f"Could not write a checkpoint to {self.backup.directory} "
            f"({getattr(error, 'strerror', None) or error}); {previous}, and "
            f"the partial one was removed. {fix}; `BackupAndRestore("
            "on_save_error='warn')` keeps training and tries again at the next "
            "save.",
        )

    def load_newest(
        self, state: TrainingState, variables_only: bool, refuse_config_changes: bool
    ) -> ResumePoint | None:
        """Loads the newest good checkpoint of the tier `newest_good()`
        picks into `state` (`TrainingState.apply()`'s arguments); `None` if
        there is none."""

        # The weights are read while the checkpoint is checksummed.
        store, found = self.newest_good(state.read_checkpoint)
        if found is None:
            return None
        checkpoint, metadata, values = found
        try:
            point = state.apply(
                checkpoint.path,
                metadata,
                values,
                variables_only=variables_only,
                refuse_config_changes=refuse_config_changes,
                ranges=checkpoint.ranges,
            )
        finally:
            store.release(checkpoint)  # A bucket's download.
        # A bucket's checkpoint is loaded from a local copy: name the original.
        return dataclasses.replace(point, checkpoint=store.url(checkpoint))

    def newest_good(
        self, read: Callable[[Checkpoint, ReadProgress], Any]
    ) -> tuple[CheckpointStore, tuple[Checkpoint, dict, Any] | None]:
        """The store a restore reads, and its newest good checkpoint read
        (`None` if there is none): the local tier's if `LocalTier` says so,
        else the backup's."""
        found = self.tier.newest(read) if self.tier is not None else None
        if found is not None:
            events.log("tier", f"restoring from the local tier {self.local.directory}")
            return self.local, found
        if self.local is not None:
            events.log(
                "tier",
                f"restoring from {self.backup.directory}: the local tier "
                f"{self.local.directory} holds nothing newer that verifies",
            )
        return self.backup, self.backup.latest_good_read(read)


@dataclasses.dataclass(frozen=True)
class TierCopy:
    """The bucket's copy of a checkpoint the local tier committed: its files
    uploaded from the tier's disk, not written again."""

    store: CheckpointStore  # The local tier.
    checkpoint: Checkpoint  # Its commit of the save.

    def write(self, staging: Staging) -> None:
        """Writes nothing: names the checkpoint's files as the files of the
        checkpoint `staging` becomes, entries included."""
        for name, entry in self.store.manifest(self.checkpoint).items():
            if name != METADATA_FILE:  # Written by the save itself.
                staging.from_paths[name] = self.checkpoint.file(name)
                staging.digests[name] = entry


def local_tier_dir(local_dir: str, bucket: ObjectStorage, task: TaskSpec) -> str:
    """The local tier's directory for the backup in `bucket`: named after
    it (its URL and server), so that one `local_dir` serves several backups,
    never mixing them; and in a cluster after the process (several may
    share one machine)."""
    name = f"tier-{bucket.digest_name}"
    if task.num_workers > 1:
        name += f"-process-{task.task_index}"
    return os.path.join(local_dir, name)
