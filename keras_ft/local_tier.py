"""The local tier in front of a bucket: where a restore reads from.

With `local_dir`, every save is committed on the machine's own disk first
and then uploaded; a restart on the same machine restores from that disk
with no download. Which one a restore reads is decided here: the tier's
newest save that every process holds, unless the bucket holds a later one
or a tier checkpoint does not verify (or, for a model split across
processes, does not hold every piece this layout needs). The processes agree
before any of them loads: all from their tiers at one step, or all from the
bucket.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent import futures
from typing import Any

from keras_ft import events, threads
from keras_ft.backend import cross_process
from keras_ft.checkpoint.files import ReadProgress
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute import sharded
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.errors import CorruptCheckpointError
from keras_ft.state.training_state import TrainingState

# In a local tier: the bucket checkpoint it last copied there.
_UPLOADED_NOTICE = "uploaded.json"


_POSITION_KEYS = ("epochs_completed", "batches_completed", "step")


def _position(metadata: dict) -> tuple[int, int, int]:
    """How far training was at a save, from its (unverified) metadata;
    `(-1, -1, -1)` if it does not say."""
    values = [metadata.get(k) for k in _POSITION_KEYS]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return tuple(values)  # type: ignore[return-value]
    return (-1, -1, -1)


class LocalTier:
    """A process's local tier (`store`) in front of the backup's bucket.

    Args:
        store: The tier's checkpoints on this machine's disk.
        bucket: The backup's checkpoints in the bucket.
        task: This process's role (the chief asks the bucket).
        state: The training state (the model's layout, its variables).
    """

    def __init__(
        self,
        store: CheckpointStore,
        bucket: CheckpointStore,
        task: TaskSpec,
        state: TrainingState,
    ):
        self.store, self.bucket, self.task = store, bucket, task
        self._state = state

    def newest(
        self, read: Callable[[Checkpoint, ReadProgress], Any]
    ) -> tuple[Checkpoint, dict, Any] | None:
        """The local tier's newest checkpoint, read, if it is at least as new
        as the bucket's and verifies; else `None` (the bucket is read)."""
        # The chief asks the bucket how far its newest save went while the
        # tier is listed and read: the round trips to the bucket then cost a
        # restore from the tier nothing.
        bucket = None
        if self.task.is_chief:
            bucket = threads.in_thread(self._bucket_newest, name="keras-ft-transfer")
        try:
            with cross_process.collectives_scope(self._state.model):
                return self._tier_or_none(read, bucket)
        finally:
            # Done before the restore reads the bucket itself: two reads of
            # one object at once are not safe on every filesystem (memory://
            # hands both threads the same file object).
            if bucket is not None:
                futures.wait([bucket])

    def _tier_or_none(
        self,
        read: Callable[[Checkpoint, ReadProgress], Any],
        bucket: futures.Future | None,
    ) -> tuple[Checkpoint, dict, Any] | None:
        """`newest()`, the chief's look at the bucket under way in
        `bucket`."""
        # Each process's saves, by step: after a kill, some processes hold
        # a save or two more than others (a write in flight, steps run on).
        saves: dict[int, tuple[Checkpoint, tuple[int, int, int]]] = {}
        for checkpoint in self.store.checkpoints():
            position = _position(self.store.unverified_metadata(checkpoint))
            if position[2] >= 0:
                saves[position[2]] = (checkpoint, position)
        # The newest step every process's tier holds (an empty tier, a new
        # machine, holds none: then all restore from the bucket).
        step = cross_process.least_in_all_processes(max(saves, default=-1))
        mine = saves.get(step)
        if self._state.sharded():
            # The read runs collectives: every process reaches it, or none.
            # Its files but the pieces (checked as read) are checked first.
            intact = mine is not None and self._covers_this_layout(mine[0])
            if not cross_process.all_processes_agree(intact):
                return None
        found = None if mine is None else self._fetch(mine[0], read)
        # Every process restores from its tier at that step, or all from the
        # bucket: they agree before any of them loads. (The chief's verdict
        # on the bucket holds for all: their points are the same; it is
        # awaited after the tier's read.)
        usable = found is not None and not _bucket_newer(bucket, mine[1])
        if not cross_process.all_processes_agree(usable):
            if found is not None:
                self.store.release(found[0])
            return None
        return found

    def _covers_this_layout(self, checkpoint: Checkpoint) -> bool:
        """Whether a tier checkpoint of a sharded save verifies (but its
        pieces) and holds every slice this process's devices need (said
        if not)."""
        try:
            self.store.verify(checkpoint, whole=False)
            gap = sharded.missing_in(
                checkpoint.path,
                self._state.saved_variables(),
                self._state.variable_specs(),
            )
        except CorruptCheckpointError as e:
            self._warn_damaged_tier(checkpoint, e)
            return False
        if gap is not None:
            events.warn(
                "tier",
                f"keras-ft: the local tier's checkpoint {checkpoint.name} holds "
                "this process's pieces of the layout it was saved in, and "
                f"this layout needs others (of {gap}); every process "
                f"restores from {self.bucket.directory} instead.",
                stacklevel=5,
            )
        return gap is None

    def _fetch(
        self, checkpoint: Checkpoint, read: Callable[[Checkpoint, ReadProgress], Any]
    ) -> tuple[Checkpoint, dict, Any] | None:
        """A tier checkpoint, read and verified; `None` (said) if damaged."""
        try:
            return self.store.fetch(checkpoint, read)
        except CorruptCheckpointError as e:
            self._warn_damaged_tier(checkpoint, e)
            return None

    def _warn_damaged_tier(self, checkpoint: Checkpoint, error: Exception) -> None:
        events.warn(
            "tier",
            f"keras-ft: the local tier's checkpoint {checkpoint.name} is damaged "
            f"({error}); every process restores from "
            f"{self.bucket.directory} instead.",
            stacklevel=5,
        )

    def _bucket_newest(self) -> tuple[int, int, int] | None:
        """How far training was at the bucket's newest checkpoint, or `None`
        if the bucket holds none."""
        bucket = self.bucket.checkpoints()
        return self._bucket_position(bucket[-1]) if bucket else None

    def uploading(self, checkpoint: Checkpoint, metadata: dict) -> None:
        """Notes in the local tier, right before the bucket commits
        `checkpoint` (saved at `metadata`'s point), that it may be the
        bucket's newest: a process killed before `uploaded()` (between the
        commit and its note) still finds it noted."""
        self._note(self._read_note().get("committed"), _noted(checkpoint, metadata))

    def uploaded(self, checkpoint: Checkpoint, metadata: dict) -> None:
        """Notes in the local tier that `checkpoint` (saved at `metadata`'s
        point) is the bucket's newest, as far as this machine knows: a
        restore that finds it so reads nothing in the bucket but its
        listing."""
        self._note(committed=_noted(checkpoint, metadata))

    def upload_failed(self) -> None:
        """Takes back `uploading()`'s note: that commit did not happen, and
        its number may go to another checkpoint."""
        self._note(self._read_note().get("committed"))

    def _note(self, committed: dict | None, committing: dict | None = None) -> None:
        """Writes the note: the bucket checkpoint this machine last
        committed, and the one it is committing (if any). Unwritten, the
        note is only out of date: a restore then reads the bucket's."""
        note = {"committed": committed}
        if committing is not None:
            note["committing"] = committing
        try:
            self.store.replace_notice(_UPLOADED_NOTICE, json.dumps(note).encode())
        except OSError as e:
            events.log("tier", f"the local tier's note of uploads is not written: {e}")

    def _read_note(self) -> dict:
        """The note's entries by name (`{}` if there is none or it is
        damaged); a note of an earlier version is its `committed` entry."""
        try:
            note = json.loads(self.store.read_notice(_UPLOADED_NOTICE) or b"")
        except (OSError, ValueError, RecursionError):
            return {}
        if isinstance(note, dict) and "sequence" in note:
            return {"committed": note}
        return note if isinstance(note, dict) else {}

    def _bucket_position(self, newest: Checkpoint) -> tuple[int, int, int]:
        """How far training was at the bucket's newest checkpoint: from this
        machine's note if it committed that one, else from its metadata."""
        for entry in self._read_note().values():
            try:
                if entry["sequence"] == newest.sequence:
                    return _position(
                        dict(zip(_POSITION_KEYS, entry["position"], strict=True))
                    )
            except (TypeError, KeyError, ValueError):
                continue  # A damaged entry: the bucket says.
        return _position(self.bucket.unverified_metadata(newest))


def _noted(checkpoint: Checkpoint, metadata: dict) -> dict:
    """A bucket checkpoint as the note names it."""
    return {"sequence": checkpoint.sequence, "position": _position(metadata)}


def _bucket_newer(
    bucket: futures.Future | None, position: tuple[int, int, int]
) -> bool:
    """Whether the chief's look at the bucket (`None` elsewhere) found a
    save later than `position`."""
    newest = bucket.result() if bucket is not None else None
    return newest is not None and position < newest
