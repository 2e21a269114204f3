"""A save of a model split across processes: each process writes its share
(the pieces it holds) as a part, and the chief's commit waits for every
part (`keras_ft/distribute/sharded.py`). With a local tier, each process
first commits every piece it holds there, as a checkpoint of its own.

Where saves snapshot on the device (`snapshot=`), training waits for a copy
of the variables there and each device's check of its pieces; the move of
the process's pieces to host memory runs in the background, before their
write."""

from __future__ import annotations

import dataclasses
from concurrent import futures
from concurrent.futures import Future

from keras_ft import threads
from keras_ft.backend import cross_process, device_memory, finiteness
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.checkpoint.parts import Parts
from keras_ft.distribute import sharded
from keras_ft.distribute.cluster import TaskSpec
from keras_ft.errors import NonFiniteStateError
from keras_ft.saves.chief import ChiefSaver
from keras_ft.saves.queue import SaveQueue
from keras_ft.saves.tiers import TieredStore
from keras_ft.state import Snapshot, TrainingState, arrays
from keras_ft.state.snapshots import SnapshotPlace
from keras_ft.state.training_state import optimizer_step


class ShardedSaver:
    """Saves of a model split across processes.

    Args:
        state: The training state.
        task: This process's role.
        queue: The training's saves in flight.
        tiers: Where they commit.
        committer: Starts a commit (the chief's, or a local tier's).
        snapshots: Where a save copies the state (`snapshot=`).
    """

    def __init__(
        self,
        state: TrainingState,
        task: TaskSpec,
        queue: SaveQueue,
        tiers: TieredStore,
        committer: ChiefSaver,
        snapshots: SnapshotPlace,
    ):
        self._state, self._task, self._queue = state, task, queue
        self._tiers, self._committer = tiers, committer
        self._snapshots = snapshots
        self._moving: Future | None = None  # The last share's move to host memory.
        self._saves = 0  # Parts are named by it: the same in every process.

    def back_up(
        self,
        epochs_completed: int,
        batches_completed: int,
        extra: dict | None,
        replaces_last: bool,
        to_bucket: bool,
    ) -> Checkpoint | None:
        """Every process copies the pieces it holds and writes them in the
        background into the save's parts; the chief's write then waits for
        every process's part and commits."""
        # One share in host memory at a time; and a failed write raises here.
        self._queue.wait()
        chief = self._task.is_chief
        tiered = self._tiers.local is not None
        self._committer.before_save(epochs_completed)
        names = [spec[1] for spec in self._state.variable_specs()]
        on_device = self._snapshots.on_device(self._state.saved_variables)
        snapshot = None
        if chief or tiered:
            snapshot = self._state.snapshot(
                epochs_completed, batches_completed, extra, on_device=on_device
            )
        source, bad = self._copy(snapshot, names, on_device)
        # A piece only one process holds may be the one that is not finite.
        # Every process agrees the same way whichever way it copied.
        if not cross_process.all_processes_agree(not bad):
            raise NonFiniteStateError(bad or ["another process's pieces"])
        if isinstance(source, sharded.Share):
            share: Future = Future()
            share.set_result(source)
        else:
            # The copies on the device go with the move.
            share = self._moving = threads.submit(
                self._queue.pools.mover, self._state.share, source
            )
        self._saves += 1
        tag = f"{self._saves:08d}-{optimizer_step(self._state.model):012d}"
        if tiered:
            self._commit_own(snapshot, share, tag, replaces_last)
            if not to_bucket:
                return self._queue.committed()
            # The bucket's save of the same share follows, in its own commit.
            replaces_last = False
        return self._write_parts(snapshot, share, tag, replaces_last)

    def _copy(
        self, snapshot: Snapshot | None, names: list[str], on_device: bool
    ) -> tuple[sharded.Share | list, list[str]]:
        """This process's share in host memory, or the variables copied on
        their devices (to be moved by `TrainingState.share()`), and the
        names of the variables not finite in it."""
        if self._moving is not None:
            # Into the memory of the last share: wait until it is in there.
            futures.wait([self._moving])  # Its error is its write's.
            self._moving = None
        if on_device:
            try:
                variables = self._state.saved_variables()
                copies, _ = device_memory.device_snapshot(
                    [device_memory.raw_value(v) for v in variables]
                )
                bad = finiteness.non_finite_pieces(copies)
            except Exception as e:
                if not self._snapshots.out_of_memory(e):
                    raise
            else:
                return copies, [names[i] for i in sorted(bad)]
        share = snapshot.share if snapshot is not None else None
        if share is None:
            share = self._state.share()
        return share, sharded.non_finite(share, names)

    def _commit_own(
        self, snapshot: Snapshot, share: Future, tag: str, replaces_last: bool
    ) -> None:
        """Commits every piece this process holds in its local tier."""
        own = OwnPart(
            self._task.task_index, tag, share, self._state.variable_specs(),
            self._state.layouts(), arrays.to_bytes(snapshot.arrays),
        )  # fmt: skip
        self._committer.start(snapshot, replaces_last, own, to_bucket=False)

    def _write_parts(
        self,
        snapshot: Snapshot | None,
        share: Future,
        tag: str,
        replaces_last: bool,
    ) -> Checkpoint | None:
        """Each process writes its part where the backup's storage keeps a
        save's parts (`Storage.parts()`: beside the checkpoints on a disk,
        in the checkpoint's own prefix in a bucket), in the background; the
        chief's commit waits for every part. No process waits for another."""
        storage = self._tiers.backup.storage
        chief = self._task.is_chief
        # The chief holds the lock and has no write in flight: the next
        # number is free. A collective, as every sharded save's check.
        sequence = cross_process.first_process_value(
            storage.next_sequence() if chief else 0
        )
        parts = storage.parts(tag, sequence)
        process = self._task.task_index
        if not chief:
            self._queue.run(_write_part, parts, process, tag, share, self._queue.pools)
            return None
        gathered = GatheredParts(
            OwnPart(
                process, tag, share, self._state.variable_specs(),
                self._state.layouts(), arrays.to_bytes(snapshot.arrays),
            ),
            parts, self._task.num_workers,
        )  # fmt: skip
        self._committer.start(snapshot, replaces_last, gathered, direct=True)
        return self._queue.committed()


@dataclasses.dataclass(frozen=True)
class OwnPart:
    """A process's share as its own checkpoint's files (in its local tier):
    every piece it holds, and the training's arrays."""

    process: int
    tag: str  # The save's name, the same in every process.
    share: Future  # The process's pieces in host memory (`sharded.Share`).
    specs: list  # Every variable's path, shape and dtype.
    layouts: list  # How each variable is split across processes.
    arrays: bytes  # The snapshot's other arrays (`state.arrays`).

    def write(self, staging: Staging) -> None:
        sharded.write_own_part(
            staging, self.process, self.tag, self.share.result(), self.specs,
            self.layouts,
        )  # fmt: skip
        staging.write_file(arrays.ARRAYS_FILE, [self.arrays])


@dataclasses.dataclass(frozen=True)
class GatheredParts:
    """The chief's commit of a sharded save: its own part written where
    the parts wait, then every process's part gathered into the checkpoint
    (the chief's write waits for them), and the training's arrays."""

    own: OwnPart  # The chief's share, and what every part shares.
    parts: Parts  # Where the processes' parts wait for the commit.
    processes: int

    def write(self, staging: Staging) -> None:
        own = self.own
        hasher = staging.pools.hasher if staging.pools is not None else None
        sharded.write_part(
            self.parts, own.process, own.tag, own.share.result(), staging.cancel,
            hasher,
        )  # fmt: skip
        self.parts.remove_earlier()  # Of saves called off (or killed) before.
        sharded.commit_parts(
            staging, self.parts, self.processes, own.tag, own.specs, own.layouts
        )
        staging.write_file(arrays.ARRAYS_FILE, [own.arrays])


def _write_part(
    parts: Parts,
    process: int,
    tag: str,
    share: Future,
    pools: threads.Pools,
) -> None:
    """A process's part of a sharded save, in the writer thread (a process
    other than the chief: the chief's commit waits for every part), after
    the local tier's commit of this save where there is one (the writer
    runs them in order): the bucket never holds a save some tier lacks."""
    sharded.write_part(parts, process, tag, share.result(), hasher=pools.hasher)
