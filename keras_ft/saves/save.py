"""One save on its way through the writer thread: the record a saver hands
over (`Save`), and how a snapshot's files are written (`write_snapshot()`).

A save's stages, in order: the snapshot (`state/`, in the training thread),
its move and check (`state/weights_copy.py`, in the background), the write
(`write_snapshot()`, in the writer thread, following the copy), the commit
(`saves/tiers.py` over `checkpoint/store.py`: after the save before it, the
writer's lock checked, then numbered) and the retirement of the checkpoints
past `keep`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

from keras_ft import threads
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.errors import NonFiniteStateError, SaveCancelled
from keras_ft.state import WEIGHTS_FILE, Snapshot, arrays
from keras_ft.state.training_state import progress_text
from keras_ft.threads import PendingWrite


class SaveFiles(Protocol):
    """How a save's files are laid out, where they are not the snapshot's
    own (a sharded save's parts: `saves/shards.py`): a record of what to
    write, written in the writer thread."""

    def write(self, staging: Staging) -> None:
        """Writes the files into the staging directory `staging`."""
        ...


@dataclasses.dataclass
class Save:
    """One save on its way through the writer thread: what it writes, where
    it commits, and what calls it off.

    Args:
        snapshot: The state it writes.
        files: Its files, where they are laid out otherwise (`SaveFiles`);
            `None`: the snapshot's own files (`write_snapshot()`).
        to_bucket: With a local tier, whether a copy also goes to the
            bucket (`TieredStore.commit()`).
        direct: A sharded save's own commit, straight into the backup.
        cancel: Set to call the save off (a move to host memory stops on
            it too).
        replaced: The write of the save it supersedes (`replaces_last`),
            set by the queue.
        pools: The training's helper threads, that checksum and fsync its
            files.
    """

    snapshot: Snapshot
    files: SaveFiles | None = None
    to_bucket: bool = True
    direct: bool = False
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    replaced: PendingWrite | None = None
    pools: threads.Pools | None = None

    def write_files(self, staging: Staging) -> None:
        """Writes the save's files into `staging` (in the writer thread)."""
        if self.files is not None:
            self.files.write(staging)
        else:
            write_snapshot(self.snapshot, staging)

    def superseded(self) -> Checkpoint | None:
        """What the save it supersedes committed, once that is over (it
        was called off when this one started, so it ends soon)."""
        if self.replaced is None:
            return None
        self.replaced.join()
        return self.replaced.value


def write_snapshot(snapshot: Snapshot, directory: str | Staging) -> None:
    """Writes a snapshot's files into a checkpoint's staging `directory`.

    A copy still being made (`snapshot(fill=False)`) is written as it
    fills; its buffer is free for the next copy once the file is written.
    """
    staging = directory if isinstance(directory, Staging) else Staging(directory)
    captured = snapshot.weights
    try:
        staging.write_file(
            WEIGHTS_FILE,
            captured.chunks,
            filled=captured.filled,
            written=captured.free,
        )
    finally:
        snapshot.release()
    if captured.non_finite:  # Known once the file is written: never committed.
        if not captured.checked_later:
            # Checked during the copy: `back_up()` raised it, and called the
            # write off (it may not have seen that yet).
            raise SaveCancelled(f"{staging} holds a state that is not finite.")
        metadata = snapshot.metadata
        raise NonFiniteStateError(
            captured.non_finite,
            progress_text(metadata["epochs_completed"], metadata["batches_completed"]),
        )
    staging.write_file(arrays.ARRAYS_FILE, [arrays.to_bytes(snapshot.arrays)])
