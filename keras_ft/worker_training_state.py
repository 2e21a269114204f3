"""`WorkerTrainingState`: back up and restore one worker's training state."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import keras

from keras_ft import backend as host
from keras_ft import errors, events, threads
from keras_ft.checkpoint.errors import (
    CheckpointWriteError,
    LeaseLapsedError,
    ProcessesDisagreeError,
    SaveCancelled,
)
from keras_ft.checkpoint.files import ReadProgress, Staging
from keras_ft.checkpoint.format import METADATA_FILE, is_url, local_path
from keras_ft.checkpoint.lock import DirectoryLock, check_platform
from keras_ft.checkpoint.store import (
    Checkpoint,
    CheckpointStore,
    open_storage,
    open_store,
)
from keras_ft.distribute import sharded
from keras_ft.distribute.cluster import (
    TaskSpec,
    chief_dir,
    current_task,
    worker_temp_name,
)
from keras_ft.local_tier import LocalTier
from keras_ft.state import (
    WEIGHTS_FILE,
    NonFiniteStateError,
    ResumePoint,
    Snapshot,
    TrainingState,
    arrays,
)
from keras_ft.state.snapshots import SnapshotPlace
from keras_ft.state.training_state import optimizer_step, progress_text
from keras_ft.state.weights_copy import CapturedWeights
from keras_ft.threads import BackgroundWriter, PendingWrite, wait_for_removals
from keras_ft.training import goodput
from keras_ft.training.listeners import CheckpointListener, check_listeners, notify
from keras_ft.training.policy import KeepLast

if TYPE_CHECKING:  # fsspec is optional.
    from keras_ft.checkpoint.remote import ObjectStorage

# One writer per chief directory in this process, shared by every
# WorkerTrainingState on it: a fit() that raised may leave a write in flight,
# and the next fit() on the same directory must wait for it.
_writers: dict[str, BackgroundWriter] = {}
# The training of this process that holds each chief directory's lock (and
# the thread pools): a later one on the same directory closes it, since Keras
# calls no `on_train_end` for a fit() that raised.
_holders: dict[str, weakref.ref] = {}


def wait_for_backups() -> None:
    """Waits until every backup being written in the background is committed.

    `fit()` waits by itself at train end; call this after `fit()` raised, to
    look at the backup directory, or before copying it elsewhere.

    Raises:
        keras_ft.CheckpointWriteError: if one of those writes failed.
    """
    for writer in list(_writers.values()):
        writer.wait()
    wait_for_removals()


class WorkerTrainingState:
    """Backs up and restores a model's training state, crash-safely.

    This is the class behind `keras_ft.BackupAndRestore`, usable on its own in
    a custom training loop. Each `back_up()` commits a new checkpoint (model
    variables, optimizer variables including `iterations`, and the epoch and
    batch counters) into `<backup_dir>/chief/`, atomically: a crash at any
    instant leaves the previous checkpoint loadable. `restore()` loads the
    newest checkpoint that passes its checksums, falling back to older ones.

    In a cluster only the chief commits; another worker writes its save into
    `<backup_dir>/workertemp_<index>/` and removes it right after, so that
    backends which need every worker to read distributed variables can do so.

    Args:
        model: A compiled `keras.Model`.
        backup_dir: Directory for the backup. Files other than the ones
            keras-ft creates are never touched.
        keep: How many committed checkpoints to keep, at least 1. Defaults
            to `2`, so that a damaged newest checkpoint has a fallback.
        async_save: If `True`, `back_up()` returns once the state is copied
            to host memory, and a background thread writes and commits it;
            `wait()` waits for the commit. If `False`, `back_up()` returns
            the committed checkpoint. Either way the copy and the write
            overlap, piece by piece; in the background, once the last
            save's write is over, the state's NaN/infinity check follows
            the copy too, so that `back_up()` waits for the copy alone.
            Defaults to `False`.
        task: This process's role; detected from the framework if `None`.
            Defaults to `None`.
        listeners: `keras_ft.CheckpointListener`s told before each save,
            after each commit and after a restore (on the chief). Defaults
            to `None`.
        storage_options: With an fsspec URL as `backup_dir`, options for
            its filesystem (credentials, endpoint). Defaults to `None`.
        verbose: `1` to report the progress of large uploads to object
            storage, `0` for silence. Defaults to `0`.
        on_config_change: What `restore()` does with a backup written by a
            training whose model, optimizer or loss was configured
            otherwise: `"warn"` to restore it and warn, naming what differs,
            or `"raise"` to refuse it with `keras_ft.ConfigurationChangedError`
            before loading anything. Defaults to `"warn"`.
        manifest_key: A secret (string or bytes) for a backup others can
            write to (a shared bucket or disk): every manifest is signed with
            it (HMAC-SHA256), and a checkpoint whose manifest is unsigned or
            signed with another key is refused as damaged, falling back to an
            older one. Defaults to `None`: the environment's
            `KERAS_FT_MANIFEST_KEY` if set, else no signatures.
        local_dir: With a bucket as `backup_dir`, a directory on this
            machine's own disk for a fast tier: every save is committed
            there first, and `back_up(to_bucket=False)` commits there only.
            `restore()` loads the local tier's newest checkpoint, with no
            download, when it is at least as new as the bucket's (a machine
            that came back empty restores from the bucket). The tier keeps
            `keep` checkpoints (at least 4 in a cluster) in a subdirectory
            named after `backup_dir` (and the process): one process, or a
            cluster whose processes can agree (JAX's, under `ModelParallel`
            each process's pieces; the model's `MultiWorkerMirroredStrategy`;
            a `torch.distributed` group). Defaults to `None`.
        check_extra: A function given the `extra` a checkpoint holds
            (`back_up(extra=...)`), before `restore()` sets anything: it
            raises `ValueError` or `TypeError` for one this training cannot
            use, and that checkpoint is then treated as damaged (the restore
            falls back to the one before). A backup is untrusted input.
            Defaults to `None`: `extra` is only checked to be JSON values
            and arrays.
        snapshot: Where a save copies the state that training then waits
            for: `"device"`, into new buffers on the accelerator holding it
            (milliseconds), then to host memory beside the next steps;
            `"host"`, straight into host memory (on a GPU, about a second
            per GB); `"auto"`, on the device where the state is on an
            accelerator with room for one more copy of it, else in host
            memory (on the CPU the two are one copy). Defaults to `"auto"`.

    Example:

    ```python
    state = keras_ft.WorkerTrainingState(model, "/tmp/backup")
    resume = state.restore()
    first_epoch = resume.epoch if resume else 0
    for epoch in range(first_epoch, epochs):
        train_one_epoch(model)
        state.back_up(epoch)
    state.delete_backup()
    ```
    """

    def __init__(
        self,
        model: keras.Model,
        backup_dir: str | os.PathLike,
        *,
        keep: int = 2,
        task: TaskSpec | None = None,
        async_save: bool = False,
        listeners: list[CheckpointListener] | None = None,
        storage_options: dict | None = None,
        verbose: int = 0,
        on_config_change: str = "warn",
        manifest_key: str | bytes | None = None,
        local_dir: str | os.PathLike | None = None,
        check_extra: Callable[[dict], None] | None = None,
        snapshot: str = "auto",
    ):
        check_platform()
        self.backup_dir = validate_backup_dir(backup_dir)
        self.local_dir = validate_local_dir(local_dir, self.backup_dir)
        self.on_config_change = validate_on_config_change(on_config_change)
        self.listeners = check_listeners(listeners)
        self.task = task if task is not None else current_task()
        self._retention = KeepLast(keep)
        self._state = TrainingState(model)
        if check_extra is not None and not callable(check_extra):
            raise ValueError(
                "Invalid value for argument `check_extra`. Expected a function "
                f"or None. Received: check_extra={check_extra!r}"
            )
        self._state.check_extra = check_extra
        self._snapshots = SnapshotPlace(snapshot)
        self._moving: futures.Future | None = None  # The last snapshot's move.
        # A disk (rename commit, flock) or a bucket (manifest-last commit,
        # lease): one protocol, and nothing here asks which.
        self._chief_store = open_store(
            chief_dir(self.backup_dir),
            self._retention,
            storage_options,
            progress=sys.stdout if verbose else None,
            manifest_key=manifest_key,
        )
        self._root = open_storage(self.backup_dir, storage_options)
        self._lock = self._chief_store.writer_lock()
        # A worker's own lock, beside the directory its throwaway saves go
        # to: a second cluster's worker on the same `backup_dir` must not
        # empty it in the middle of this one's save.
        self._worker_lock: DirectoryLock | None = None
        if not self.task.is_chief:
            scratch = self._worker_dir()
            self._worker_lock = DirectoryLock(
                # `backup_dir` may be a link the user made; the lock file not.
                os.path.realpath(os.path.dirname(scratch)),
                os.path.basename(scratch) + ".lock",
                f"Worker {self.task.task_index}'s directory {scratch!r} for "
                f"backup_dir={self.backup_dir!r}",
            )
        # The fast tier on this machine's disk, its own lock beside it.
        self._local_store: CheckpointStore | None = None
        self._local_lock: Any = None
        self._tier: LocalTier | None = None  # Where a restore reads from.
        if self.local_dir is not None:
            # In a cluster, a kill leaves the processes' newest saves a few
            # apart: each keeps enough for a step they all hold.
            spread = 4 if self.task.num_workers > 1 else 1
            self._local_store = open_store(
                local_tier_dir(self.local_dir, self._root, self.task),
                KeepLast(max(keep, spread)),
                manifest_key=manifest_key,
            )
            self._local_lock = self._local_store.writer_lock()
            # A model split across processes: each tier holds every piece
            # its process holds, to rebuild that process's slices alone.
            self._state.every_replica = True
            self._tier = LocalTier(
                self._local_store, self._chief_store, self.task, self._state
            )
        self.async_save = bool(async_save)
        self._writer = _writers.setdefault(
            self._chief_store.identity, BackgroundWriter()
        )
        self._cancels: list[threading.Event] = []  # Of the saves in flight.
        self._saves = 0  # Sharded saves name their parts by it: same everywhere.
        # The newest save, for a save that replaces it.
        self._last: tuple[threading.Event, PendingWrite] | None = None
        self._holds_pools = False  # From `lock()` to `unlock()`.
        # A save's local checkpoint, by the bucket copy made of it.
        self._copies: dict[str, Checkpoint] = {}

    @property
    def model(self) -> keras.Model:
        return self._state.model

    @property
    def store(self) -> CheckpointStore:
        """Where the chief's checkpoints are committed (a disk or a bucket);
        every process of a cluster reads its notices through it."""
        return self._chief_store

    def check_writable(self) -> None:
        """Fails early, naming `backup_dir`, if saves could not be written.

        Read-only for what is there: another process may be writing the
        backup right now. What a killed writer left is removed by `lock()`,
        once this process holds the directory.

        Raises:
            ValueError: if the directory cannot be created or written.
        """
        store = (
            self._chief_store
            if self.task.is_chief
            else CheckpointStore(self._worker_dir())
        )
        try:
            store.check_writable()
        except ValueError as e:
            raise ValueError(f"{e} Received: backup_dir={self.backup_dir!r}") from e

    def _finish_earlier_write(self) -> None:
        try:
            self._writer.wait()
        except CheckpointWriteError as e:
            events.warn(
                "save", f"A backup from an earlier fit() failed: {e}", stacklevel=3
            )

    def lock(self) -> None:
        """Claims the backup for this process: one writer per directory.

        Only the chief locks; other workers never write the chief's directory.
        Once it holds the lock, the chief removes what a killed writer left
        (staging directories, partial uploads, pieces of sharded saves); a
        worker empties its own temporary directory. The lock goes with
        `unlock()`, `delete_backup()` or the process.

        Raises:
            keras_ft.DirectoryInUseError: if another live process holds it.
        """
        self._hold()
        if self._local_store is not None:
            self._check_local_tier()
            self._finish_earlier_write()
            try:
                self._local_lock.acquire()
                self._local_store.remove_leftovers()
            except BaseException:
                self.unlock()
                raise
        if self._worker_lock is not None:  # Not the chief.
            try:
                self._worker_lock.acquire()
            except BaseException:
                self.unlock()
                raise
            # A worker's directory only ever holds the save being written.
            shutil.rmtree(self._worker_dir(), ignore_errors=True)
            return
        # A write still in flight from an earlier fit() in this process owns
        # its staging directory: let it finish before cleaning up.
        self._finish_earlier_write()
        try:
            self._lock.acquire()
            # Staging directories, partial uploads, pieces of sharded saves.
            self._chief_store.remove_leftovers()
        except BaseException:
            self.unlock()
            raise

    def _check_local_tier(self) -> None:
        """Refuses a local tier where it cannot work yet, before any save."""
        if self.task.num_workers == 1:
            return
        with self._collectives():
            if host.gathers_across_processes():
                return
        raise ValueError(
            "Invalid value for argument `local_dir`: in a run of "
            f"{self.task.num_workers} processes, the processes agree on which "
            "tier to restore from before any of them loads, through a JAX "
            "cluster, a `tf.distribute.MultiWorkerMirroredStrategy` (the "
            "model's) or an initialised `torch.distributed` group, and this "
            "run has none of them. Build the model under such a strategy, or "
            f"pass local_dir=None. Received: local_dir={self.local_dir!r}"
        )

    def _collectives(self) -> contextlib.AbstractContextManager:
        """Where the processes' agreements run (`backend.collectives_scope()`)."""
        return host.collectives_scope(self.model)

    @contextlib.contextmanager
    def locked(self) -> Iterator[WorkerTrainingState]:
        """`lock()` for a block: released if the block raises, held after it.

        ```python
        with state.locked():
            resume = state.restore()  # A failed restore releases the lock.
        ```
        """
        self.lock()
        try:
            yield self
        except BaseException:
            self.unlock()
            raise

    def _worker_dir(self) -> str:
        """Where a worker that is not the chief writes the save it throws
        away: beside the chief's directory on a disk, a local directory for
        a bucket."""
        return self._chief_store.storage.scratch_dir(
            worker_temp_name(self.task.task_index)
        )

    def unlock(self) -> None:
        """Releases the lock (see `lock()`); the backup stays as it is."""
        self._lock.release()
        if self._worker_lock is not None:  # Beside the backup: leave no trace.
            self._worker_lock.release(remove=True)
        if self._local_lock is not None:
            self._local_lock.release()
        self._let_go()

    def close(self) -> None:
        """Ends this training's background work: waits for its writes to
        commit, releases the lock (which stops a lease's heartbeat) and,
        if no other training of the process is running, closes the thread
        pools its saves used. The backup stays as it is.

        Raises:
            keras_ft.CheckpointWriteError: if a write in flight failed (the
                lock is released all the same).
        """
        try:
            self.wait()
        finally:
            self.unlock()

    def _hold(self) -> None:
        identity = self._chief_store.identity
        earlier = _holders.get(identity)
        earlier = earlier() if earlier is not None else None
        if earlier is not None and earlier is not self:
            # Left by a fit() that raised: its writes commit, then its lock
            # and its hold on the pools go.
            try:
                earlier.wait()
            except (CheckpointWriteError, NonFiniteStateError) as e:
                events.warn(
                    "save", f"A backup from an earlier fit() failed: {e}", stacklevel=4
                )
            finally:
                earlier.unlock()
        _holders[identity] = weakref.ref(self)
        if not self._holds_pools:
            self._holds_pools = True
            threads.hold()

    def _let_go(self) -> None:
        identity = self._chief_store.identity
        held = _holders.get(identity)
        if held is not None and held() is self:
            del _holders[identity]
        if self._holds_pools:
            self._holds_pools = False
            threads.let_go()

    def back_up(
        self,
        epoch: int,
        batch: int | None = None,
        extra: dict | None = None,
        *,
        replaces_last: bool = False,
        to_bucket: bool = True,
    ) -> Checkpoint | None:
        """Saves the current state.

        Args:
            epoch: Zero-based index of the epoch being trained.
            batch: Number of batches of `epoch` trained so far, or `None` if
                `epoch` is complete. Defaults to `None`.
            extra: More state to save, a tree of JSON values and NumPy
                arrays; `restore()` returns it in `ResumePoint.extra`.
                Defaults to `None`.
            replaces_last: If `True`, this save supersedes the previous one
                (same training progress, more state): the previous one is
                called off if it is still being written, or deleted once
                this one is committed. Defaults to `False`.
            to_bucket: With a local tier (`local_dir`), whether this save
                also goes to the bucket once committed locally; `False`
                commits it locally only. Defaults to `True`.

        Returns:
            The committed checkpoint on the chief; `None` on other workers,
            and with `async_save` (see `wait()`).

        Raises:
            keras_ft.NonFiniteStateError: if a model or optimizer variable
                holds a NaN or an infinity; nothing is committed. With
                `async_save`, the check runs in the background when the
                last save's write is over: its error is then raised by a
                later call (`back_up()`, `wait()`, `close()`), like a failed
                write's, and says which save it was (`at`).
            keras_ft.CheckpointWriteError: if this write, or with
                `async_save` the previous one, failed.
        """
        epochs_completed = epoch + 1 if batch is None else epoch
        batches_completed = 0 if batch is None else batch
        if self._state.sharded():
            return self._back_up_sharded(
                epochs_completed, batches_completed, extra, replaces_last, to_bucket
            )
        chief = self.task.is_chief
        if not chief and self._local_store is None:
            # Written right away, a snapshot can view the variables: no copy.
            snapshot = self._state.snapshot(
                epochs_completed, batches_completed, extra, copy=False
            )
            temp_dir = self._worker_dir()
            try:
                CheckpointStore(temp_dir).save(
                    functools.partial(write_snapshot, snapshot), snapshot.metadata
                )
            finally:
                shutil.rmtree(temp_dir, ignore_errors=True)
            return None
        if chief:
            notify(
                self.listeners,
                "before_save",
                epochs_completed,
                optimizer_step(self.model),
            )
        # Another worker's local tier keeps its saves; only the chief uploads.
        to_bucket = to_bucket and chief
        # The copy goes into the buffer the saves in flight share: each value
        # waits until the save before has written it out, and this save's
        # write follows the copy, so the disk never waits for all of it. In
        # the background, once the last write is over, the NaN/infinity check
        # follows the copy too (the write follows the check): training then
        # waits for the copy alone, and the writer refuses a non-finite state
        # before its commit.
        # On an accelerator, the copy training waits for is one on the device;
        # its move to host memory (and the check) follow in the background.
        snapshot = self._snapshot_to_write(epochs_completed, batches_completed, extra)
        try:
            cancel = self._start_commit(snapshot, replaces_last, to_bucket=to_bucket)
        except BaseException:
            snapshot.release()  # Never written: the next copy must not wait.
            raise
        if snapshot.weights.from_device:
            move = threads.submit(threads.mover, _move_to_host, snapshot.weights)
            self._moving = move
        else:
            snapshot.weights.fill()  # On failure, the write sees it and calls off.
        # Checked during the copy. A check that follows the copy is the
        # writer's to report, even if it is already over.
        if not snapshot.weights.checked_later and snapshot.weights.non_finite:
            cancel.set()  # The write stops where it is and commits nothing.
            raise NonFiniteStateError(snapshot.weights.non_finite)
        return self._committed_unless_async()

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
        try:
            return self._state.snapshot(
                epochs_completed,
                batches_completed,
                extra,
                copy=True,
                fill=False,
                check_later=self.async_save or on_device,
                on_device=on_device,
            )
        except Exception as e:
            if not (on_device and self._snapshots.out_of_memory(e)):
                raise
        return self._snapshot_to_write(epochs_completed, batches_completed, extra)

    def _start_commit(
        self,
        snapshot: Snapshot,
        replaces_last: bool,
        write: Callable[[Staging], None] | None = None,
        to_bucket: bool = True,
        direct: bool = False,
    ) -> threading.Event:
        """Hands `snapshot`'s write and commit to the writer thread.

        Returns:
            The event that calls this save off.
        """
        cancel = threading.Event()
        replaced = None
        if replaces_last and self._last:
            cancel_last, replaced = self._last
            cancel_last.set()  # Before this copy waits for its write to pass.
        pending = self._writer.submit(
            lambda previous: self._commit(
                snapshot, cancel, previous, replaced, write, to_bucket, direct
            )
        )
        self._last = (cancel, pending)
        self._cancels.append(cancel)
        # Only the newest `depth` saves can still be in flight (`submit()`
        # waited for the others): a long run keeps no more events than that.
        del self._cancels[: -self._writer.depth]
        return cancel

    def _committed_unless_async(self) -> Checkpoint | None:
        if self.async_save:
            return None
        self._cancels = []
        return self._writer.wait()

    def _back_up_sharded(
        self,
        epochs_completed: int,
        batches_completed: int,
        extra: dict | None,
        replaces_last: bool,
        to_bucket: bool = True,
    ) -> Checkpoint | None:
        """A save of a model split across processes: each writes its share.

        Every process copies the pieces it holds and writes them in the
        background into the save's parts directory; the chief's write then
        waits for every process's part and commits (`distribute/sharded.py`).
        With a local tier, each process first commits every piece it holds
        there, as a checkpoint of its own.
        """
        storage = self._chief_store.storage
        parts_root = storage.filesystem_path
        # One share in host memory at a time; and a failed write raises here.
        self._writer.wait()
        chief = self.task.is_chief
        tiered = self._local_store is not None
        if chief:
            notify(
                self.listeners,
                "before_save",
                epochs_completed,
                optimizer_step(self.model),
            )
        snapshot = None
        if chief or tiered:
            snapshot = self._state.snapshot(epochs_completed, batches_completed, extra)
            share = snapshot.share
        else:
            share = self._state.share()
        specs = self._state.variable_specs()
        bad = sharded.non_finite(share, [spec[1] for spec in specs])
        # A piece only one process holds may be the one that is not finite.
        if not host.all_processes_agree(not bad):
            raise NonFiniteStateError(bad or ["(a piece another process holds)"])
        self._saves += 1
        tag = f"{self._saves:08d}-{optimizer_step(self.model):012d}"
        process = self.task.task_index
        if tiered:
            assert snapshot is not None
            layouts = self._state.layouts()
            arrays_bytes = arrays.to_bytes(snapshot.arrays)

            def write_own(staging: Staging) -> None:
                sharded.write_own_part(staging, process, tag, share, specs, layouts)
                staging.write_file(arrays.ARRAYS_FILE, [arrays_bytes])

            self._start_commit(snapshot, replaces_last, write_own, to_bucket=False)
            if not to_bucket:
                return self._committed_unless_async()
            # The bucket's save of the same share follows, in its own commit.
            replaces_last = False
        if parts_root is None:  # A bucket: every process uploads into place.
            return self._back_up_sharded_to_bucket(
                storage, snapshot if chief else None, share, tag, replaces_last
            )
        directory = sharded.parts_dir(parts_root, tag)
        if not chief:
            self._writer.submit(
                lambda previous: sharded.write_part(directory, process, tag, share)
            )
            if not self.async_save:
                self._writer.wait()
            return None
        layouts = self._state.layouts()
        processes = self.task.num_workers

        def write(staging: Staging) -> None:
            sharded.write_part(directory, process, tag, share)
            # Parts of saves called off (or killed) before this one.
            sharded.remove_parts(parts_root, before=tag)
            sharded.commit_parts(staging, directory, processes, tag, specs, layouts)
            staging.write_file(arrays.ARRAYS_FILE, [arrays.to_bytes(snapshot.arrays)])

        self._start_commit(snapshot, replaces_last, write)
        return self._committed_unless_async()

    def _back_up_sharded_to_bucket(
        self,
        storage: Any,
        snapshot: Snapshot | None,
        share: sharded.Share,
        tag: str,
        replaces_last: bool,
    ) -> Checkpoint | None:
        """`_back_up_sharded()` into a bucket: the processes agree on the
        checkpoint's number, each uploads its part under it in the
        background, and the chief's commit (its manifest, last) waits for
        every part. No process waits for another's upload."""
        chief = self.task.is_chief
        # The chief holds the lease and has no write in flight: the next
        # number is free. A collective, as every sharded save's check.
        sequence = host.first_process_value(storage.next_sequence() if chief else 0)
        process = self.task.task_index
        if not chief:

            def upload(previous: PendingWrite | None) -> None:
                if previous is not None and self._local_store is not None:
                    # The local tier's commit of this save first: the
                    # bucket never holds a save some tier lacks.
                    previous.join()
                sharded.upload_part(storage, sequence, process, tag, share)

            self._writer.submit(upload)
            if not self.async_save:
                self._writer.wait()
            return None
        assert snapshot is not None
        specs = self._state.variable_specs()
        layouts = self._state.layouts()
        processes = self.task.num_workers

        def write(staging: Staging) -> None:
            sharded.upload_part(storage, sequence, process, tag, share, staging.cancel)
            sharded.commit_uploaded_parts(
                staging, storage, sequence, processes, tag, specs, layouts
            )
            staging.write_file(arrays.ARRAYS_FILE, [arrays.to_bytes(snapshot.arrays)])

        self._start_commit(snapshot, replaces_last, write, direct=True)
        return self._committed_unless_async()

    def wait(self) -> Checkpoint | None:
        """Waits for a background write; returns the checkpoint it committed.

        Also waits until the checkpoints it superseded are removed from disk.

        Raises:
            keras_ft.CheckpointWriteError: if that write failed.
            keras_ft.NonFiniteStateError: if its writer refused a state
                that was not finite (`async_save`); nothing was committed.
        """
        self._cancels = []
        checkpoint = self._writer.wait()
        wait_for_removals()
        return checkpoint

    @property
    def writing(self) -> bool:
        """Whether a save is being written in the background right now."""
        return self._writer.busy

    def raise_if_failed(self) -> None:
        """Raises the error of a background write that failed, without waiting."""
        self._writer.raise_if_failed()

    def prepare(self) -> None:
        """Does the one-time work of the first save now (walking the model,
        laying out the weights file, and with `async_save`, allocating the
        buffer snapshots are copied into), so that no save pays for it."""
        self._state.prepare(copy=self.task.is_chief or self._local_store is not None)

    def discard_pending(self) -> None:
        """Calls off the background writes that have not committed yet.

        For a backup about to be deleted: each write stops where it is and
        commits nothing.

        Raises:
            keras_ft.CheckpointWriteError: if one of them had failed before
                it was called off (a failed write is never silently lost).
        """
        for cancel in self._cancels:
            cancel.set()
        self._cancels = []
        self._writer.wait()  # Called-off writes end without an error.

    def _commit(
        self,
        snapshot: Snapshot,
        cancel: threading.Event,
        previous: PendingWrite | None,
        replaced: PendingWrite | None = None,
        write: Callable[[Staging], None] | None = None,
        to_bucket: bool = True,
        direct: bool = False,
    ) -> Checkpoint:
        """Writes and commits one save: into the local tier first if there
        is one (then, `to_bucket`, a copy into the bucket), or with `direct`
        (a sharded save's own commit into the bucket) into the bucket."""

        def after() -> None:
            # Commits keep the order of the saves: the one before goes first.
            if previous is not None:
                previous.join()
            if self.task.is_chief:
                self._lock.check()  # A lapsed lease: another writer may commit.

        def supersedes(tier: str) -> Callable[[], Checkpoint | None] | None:
            if replaced is None:
                return None

            def superseded() -> Checkpoint | None:
                replaced.join()
                return self._copy_in(replaced.value, tier)

            return superseded

        try:
            if self._local_store is None or direct:
                committed = self._chief_store.save(
                    write or functools.partial(write_snapshot, snapshot),
                    snapshot.metadata,
                    cancel,
                    after,
                    supersedes("bucket"),
                )
                if self._tier is not None:  # A sharded save's bucket copy.
                    self._tier.uploaded(committed, snapshot.metadata)
            else:
                committed = self._local_store.save(
                    write or functools.partial(write_snapshot, snapshot),
                    snapshot.metadata,
                    cancel,
                    after,
                    supersedes("local"),
                )
                if to_bucket:
                    local = committed
                    committed = self._chief_store.save(
                        functools.partial(_copy_of, self._local_store, local),
                        snapshot.metadata,
                        cancel,
                        self._lock.check,
                        supersedes("bucket"),
                    )
                    self._copies[committed.path] = local
                    self._tier.uploaded(committed, snapshot.metadata)
                    while len(self._copies) > 8:  # Only the newest are asked for.
                        del self._copies[next(iter(self._copies))]
        except LeaseLapsedError:
            raise  # Says itself why nothing was committed.
        except (OSError, ProcessesDisagreeError) as e:
            try:
                committed = self._chief_store.checkpoints()
            except Exception:  # A bucket out of reach cannot be listed either.
                committed = None
            if committed is None:
                previous = "the checkpoints committed before are intact"
            elif committed:
                previous = f"the previous checkpoint {committed[-1].name} is intact"
            else:
                previous = "no checkpoint had been committed yet"
            if isinstance(e, ProcessesDisagreeError):
                fix = (
                    "Relaunch every process of the training together, with the "
                    "same script and arguments"
                )
            else:
                fix = self._chief_store.write_error_fix
            raise CheckpointWriteError(
                e.errno,
                f"Could not write a checkpoint to {self._chief_store.directory} "
                f"({e.strerror or e}); {previous}, and the partial one was "
                f"removed. {fix}; `BackupAndRestore(on_save_error='warn')` keeps "
                "training and tries again at the next save.",
            ) from e
        finally:
            snapshot.release()  # Also when it failed before writing anything.
        metadata = snapshot.metadata
        notify(
            self.listeners,
            "after_commit",
            committed.path,
            metadata["epochs_completed"],
            metadata["step"],
        )
        return committed

    def _copy_in(self, checkpoint: Checkpoint | None, tier: str) -> Checkpoint | None:
        """`checkpoint` (a save's result) as committed in `tier` ("local" or
        "bucket"), or `None` if that save did not go there."""
        if checkpoint is None or self._local_store is None:
            return checkpoint
        local = self._copies.get(checkpoint.path)
        if tier == "local":
            return local if local is not None else checkpoint
        return checkpoint if local is not None else None

    def restore(self) -> ResumePoint | None:
        """Loads the newest good checkpoint into the model.

        Returns:
            Where training resumes, or `None` if there is no backup.

        Raises:
            keras_ft.NoGoodCheckpointError: if every checkpoint is damaged.
            ValueError: if the backup does not match the model.
        """
        self._finish_earlier_write()
        self._state.configuration()  # As set up, before anything is loaded.
        point = self._load_newest(variables_only=False)
        if point is not None and point.config_changes:
            events.warn(
                "restore",
                f"keras-ft: the backup {point.checkpoint} was written by a "
                "training configured otherwise: "
                f"{errors.summary(point.config_changes)}. Its state is "
                "restored and training continues with this configuration; use "
                "another `backup_dir` to start afresh, or "
                "`on_config_change='raise'` to refuse such a backup.",
                stacklevel=2,
            )
        return point

    def _load_newest(self, variables_only: bool) -> ResumePoint | None:
        """Loads the newest good checkpoint; tells the listeners."""

        # The weights are read while the checkpoint is checksummed.
        def read(checkpoint: Checkpoint, progress: ReadProgress) -> Any:
            return self._state.read_ahead(checkpoint.path, progress)

        store = self._chief_store
        found = self._tier.newest(read) if self._tier is not None else None
        if found is not None:
            store = self._local_store
            events.log("tier", f"restoring from the local tier {store.directory}")
        else:
            if self._local_store is not None:
                events.log(
                    "tier",
                    f"restoring from {self._chief_store.directory}: the local tier "
                    f"{self._local_store.directory} holds nothing newer that verifies",
                )
            found = self._chief_store.latest_good_read(read)
        if found is None:
            return None
        checkpoint, metadata, values = found
        try:
            point = self._state.apply(
                checkpoint.path,
                metadata,
                values,
                variables_only=variables_only,
                refuse_config_changes=self.on_config_change == "raise",
            )
        finally:
            store.release(checkpoint)  # A bucket's download.
        # A bucket's checkpoint is loaded from a local copy: name the original.
        point = dataclasses.replace(point, checkpoint=store.url(checkpoint))
        notify(
            self.listeners, "after_restore", point.checkpoint, point.epoch, point.step
        )
        return point

    def roll_back(self) -> ResumePoint | None:
        """Loads the newest good checkpoint's variables, in the middle of training.

        Waits for the saves in flight to commit first. Only the model's and
        optimizer's variables are loaded (bitwise as saved): counters,
        metrics and random generators go on as they are.

        Returns:
            The checkpoint loaded, or `None` if none was committed yet.

        Raises:
            keras_ft.CheckpointWriteError: if a save in flight failed.
            keras_ft.NoGoodCheckpointError: if every checkpoint is damaged.
        """
        # A save its writer refused as not finite committed nothing: the
        # newest committed backup is loaded all the same.
        with contextlib.suppress(NonFiniteStateError):
            self.wait()
        return self._load_newest(variables_only=True)

    def apply_metrics(self, values: list) -> bool:
        """Sets the model's metric variables to values from `ResumePoint.extra`.

        Returns:
            Whether the model's metric variables matched and were set.
        """
        return self._state.apply_metrics(values)

    def checkpoints(self) -> list[Checkpoint]:
        """The committed checkpoints, oldest first."""
        return self._chief_store.checkpoints()

    def delete_backup(self) -> None:
        """Deletes what this backup wrote; other files in `backup_dir` stay."""
        self._writer.wait()
        if self.task.is_chief:
            # What the run's time went to outlives its checkpoints.
            goodput.keep(self._chief_store, self._root)
            try:
                self._chief_store.clear()
            except Exception as e:  # A bucket out of reach: say so, go on.
                events.warn(
                    "save",
                    f"keras-ft: fit() is over, but its backup in "
                    f"{self._chief_store.directory} could not be deleted "
                    f"({type(e).__name__}: {e}). Delete it yourself, or "
                    "`keras-ft prune` it.",
                    stacklevel=3,
                )
            self._lock.release(remove=True)
            self._chief_store.storage.remove_root()  # Emptied of its lock file.
        else:
            shutil.rmtree(self._worker_dir(), ignore_errors=True)
            if self._worker_lock is not None:
                self._worker_lock.release(remove=True)
        if self._local_store is not None:  # Every process's own.
            self._local_store.clear()
            self._local_lock.release(remove=True)
            self._local_store.storage.remove_root()
        self._root.remove_root()  # `backup_dir` itself, if nothing else is in it.
        self._let_go()


def _move_to_host(captured: CapturedWeights) -> None:
    """`captured.fill()` in a background thread: what fails there fails the
    save's write (no caller is left to raise it)."""
    try:
        captured.fill()
    except BaseException as e:
        captured.filled.fail(e)


def write_snapshot(snapshot: Snapshot, directory: str | Staging) -> None:
    """Writes a snapshot's files into a checkpoint's staging `directory`.

    A copy still being made (`snapshot(fill=False)`) is written as it
    fills, and its buffer is released piece by piece as it is written.
    """
    staging = directory if isinstance(directory, Staging) else Staging(directory)
    captured = snapshot.weights
    try:
        if captured.previous is not None:
            # One file at a time keeps the disk writing sequentially.
            captured.previous.wait_for(captured.previous.total)
        staging.write_file(
            WEIGHTS_FILE,
            captured.chunks,
            filled=captured.filled,
            written=captured.written,
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


def validate_on_config_change(value: object) -> str:
    if value not in ("warn", "raise"):
        raise ValueError(
            "Invalid value for argument `on_config_change`. Expected 'warn' or "
            f"'raise'. Received: on_config_change={value!r}"
        )
    return value


def _copy_of(store: CheckpointStore, checkpoint: Checkpoint, staging: Staging) -> None:
    """Writes nothing: names `checkpoint`'s files (on this machine's disk)
    as the files of the checkpoint `staging` becomes, entries included."""
    for name, entry in store.manifest(checkpoint).items():
        if name != METADATA_FILE:  # Written by the save itself.
            staging.from_paths[name] = checkpoint.file(name)
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


def validate_local_dir(local_dir: object, backup_dir: str) -> str | None:
    """Returns `local_dir` as a path (or `None`), or raises a `ValueError`."""
    if local_dir is None:
        return None
    if not isinstance(local_dir, (str, os.PathLike)) or not os.fspath(local_dir):
        raise ValueError(
            "Invalid value for argument `local_dir`. Expected a path to a "
            f"directory on this machine, or None. Received: local_dir={local_dir!r}"
        )
    path = os.fsdecode(os.fspath(local_dir))
    if is_url(path):
        raise ValueError(
            "Invalid value for argument `local_dir`: it is a URL; the local tier "
            "is a directory on this machine's own disk. Received: "
            f"local_dir={path!r}"
        )
    if not is_url(backup_dir):
        raise ValueError(
            "Invalid value for argument `local_dir`: `backup_dir` is a directory "
            "already, and a local tier is for a bucket `backup_dir` (s3://, "
            "gs://...). Pass local_dir=None, or a bucket as backup_dir. Received: "
            f"local_dir={path!r}, backup_dir={backup_dir!r}"
        )
    path = local_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            "Invalid value for argument `local_dir`: it is an existing file, not "
            f"a directory. Received: local_dir={path!r}"
        )
    return path


# `s3:/bucket/run`: a URL after a path function collapsed its `//`.
_LOST_SLASH = re.compile(r"[a-z][a-z0-9+.-]*:/(?!/)")


def validate_backup_dir(backup_dir: object) -> str:
    """Returns `backup_dir` as a string, or raises a `ValueError` saying why not."""
    if not backup_dir:
        # Keras' own sentence first, so code matching its message still works.
        raise ValueError(
            "Empty `backup_dir` argument passed. Expected a non-empty path to a "
            f"directory. Received: backup_dir={backup_dir!r}"
        )
    if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
        raise ValueError(
            "Invalid value for argument `backup_dir`. Expected a non-empty path "
            f"to a directory. Received: backup_dir={backup_dir!r}"
        )
    path = os.fspath(backup_dir)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if is_url(path):
        return path.rstrip("/")  # Object storage: checked at train begin.
    if _LOST_SLASH.match(path):
        # What `os.path.join()` or `normpath()` make of a URL: as a local
        # path it would become a directory named after the scheme.
        scheme, _, rest = path.partition(":/")
        raise ValueError(
            "Invalid value for argument `backup_dir`: it looks like a URL that "
            f"lost a slash, which would be a local directory named {scheme + ':'!r}."
            f" Write it as {scheme}://{rest}, or as ./{path} for a local "
            f"directory. Received: backup_dir={path!r}"
        )
    path = local_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            "Invalid value for argument `backup_dir`: it is an existing file, not "
            "a directory. Pass a directory path (it is created if missing). "
            f"Received: backup_dir={path!r}"
        )
    return path
