"""`WorkerTrainingState`: back up and restore one worker's training state."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import keras

from keras_ft import errors, events
from keras_ft.checkpoint.lock import check_platform
from keras_ft.checkpoint.store import Checkpoint, CheckpointStore
from keras_ft.distribute.cluster import TaskSpec, current_task
from keras_ft.errors import NonFiniteStateError
from keras_ft.options import BackupOptions
from keras_ft.saves.parts import assemble
from keras_ft.state import ResumePoint, TrainingState
from keras_ft.state.weights_copy import CopyBuffer
from keras_ft.threads import wait_for_removals
from keras_ft.training.listeners import CheckpointListener, check_listeners, notify

__all__ = ["WorkerTrainingState"]


# The option arguments' defaults: set alongside a `BackupOptions`, an error.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BackupOptions)}


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
        backup_dir: Directory for the backup (or an fsspec URL). Files
            other than the ones keras-ft creates are never touched. Or a
            `keras_ft.BackupOptions` holding it and the options below
            (`keep` to `snapshot`, but `task`, `listeners`, `check_extra`).
        keep: How many committed checkpoints to keep, at least 1. Defaults
            to `2`, so that a damaged newest checkpoint has a fallback.
        async_save: If `True`, `back_up()` returns once the state is copied
            to host memory, and a background thread writes and commits it;
            `wait()` waits for the commit. If `False`, `back_up()` returns
            the committed checkpoint. Either way the write follows the
            copy, piece by piece, and the copy starts once the last save's
            weights are written out (one snapshot in flight); in the
            background the state's NaN/infinity check follows the copy
            too, so that `back_up()` waits for the copy alone. Defaults to
            `False`.
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
    with state.locked():  # One writer per directory; let go if this raises.
        resume = state.restore()
    first_epoch = resume.epoch if resume else 0
    for epoch in range(first_epoch, epochs):
        train_one_epoch(model)
        state.back_up(epoch)
    state.delete_backup()  # Or `state.close()` to keep it; either unlocks.
    ```
    """

    def __init__(
        self,
        model: keras.Model,
        backup_dir: str | os.PathLike | BackupOptions,
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
        given = {
            "keep": keep, "async_save": async_save, "storage_options": storage_options,
            "verbose": verbose, "on_config_change": on_config_change,
            "manifest_key": manifest_key, "local_dir": local_dir, "snapshot": snapshot,
        }  # fmt: skip
        if isinstance(backup_dir, BackupOptions):
            options = backup_dir
            also = [n for n, v in given.items() if v != _DEFAULTS[n]]
            if also:
                raise ValueError(
                    f"Invalid arguments {', '.join(also)}: `backup_dir` is a "
                    "`BackupOptions`, which holds them. Pass either the options or "
                    "the arguments, not both."
                )
        else:
            options = BackupOptions(backup_dir, **given)
        self.options = options
        self.backup_dir, self.local_dir = options.backup_dir, options.local_dir
        self.on_config_change = options.on_config_change
        self.async_save = options.async_save
        self.listeners = check_listeners(listeners)
        self.task = task if task is not None else current_task()
        self._state = TrainingState(model)
        if check_extra is not None and not callable(check_extra):
            raise ValueError(
                "Invalid value for argument `check_extra`. Expected a function "
                f"or None. Received: check_extra={check_extra!r}"
            )
        self._state.check_extra = check_extra
        self._state.fit_number = None
        self._parts = assemble(self, self._state, self.task, options, self.listeners)

    @property
    def model(self) -> keras.Model:
        return self._state.model

    @property
    def store(self) -> CheckpointStore:
        """Where the chief's checkpoints are committed (a disk or a bucket);
        every process of a cluster reads its notices through it."""
        return self._parts.store

    def check_writable(self) -> None:
        """Fails early, naming `backup_dir`, if saves could not be written.

        Read-only for what is there: another process may be writing the
        backup right now. What a killed writer left is removed by `lock()`,
        once this process holds the directory.

        Raises:
            ValueError: if the directory cannot be created or written.
        """
        try:
            self._parts.claim.check_writable()
        except ValueError as e:
            raise ValueError(f"{e} Received: backup_dir={self.backup_dir!r}") from e

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
        # A write still in flight from an earlier fit() in this process owns
        # its staging directory: it finishes before anything is cleaned up.
        self._parts.queue.hold()
        try:
            self._parts.tiers.lock(self.task, self.model, self.local_dir)
            self._parts.claim.acquire()
        except BaseException:
            self.unlock()
            raise

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

    def unlock(self) -> None:
        """Releases the lock (see `lock()`) once the writes in flight are
        over (a failed one is a warning); the backup stays as it is."""
        # Nothing of this training commits once another may hold the lock.
        self._parts.queue.finish()
        self._parts.claim.release()
        self._parts.tiers.unlock()
        self._parts.queue.release()

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
                write's, and says which save it was (`at`). A save that
                starts while the last one is still being written is checked
                during its copy, and raises here.
            keras_ft.CheckpointWriteError: if this write, or with
                `async_save` the previous one, failed.
        """
        epochs_completed = epoch + 1 if batch is None else epoch
        batches_completed = 0 if batch is None else batch
        if self._state.sharded():
            saver = self._parts.sharded
        elif self._parts.throwaway is not None:
            saver = self._parts.throwaway  # Commits nothing: returns `None`.
        else:
            saver = self._parts.chief
        return saver.back_up(
            epochs_completed, batches_completed, extra, replaces_last, to_bucket
        )

    def wait(self) -> Checkpoint | None:
        """Waits for a background write; returns the checkpoint it committed.

        Also waits until the checkpoints it superseded are removed from disk.

        Raises:
            keras_ft.CheckpointWriteError: if that write failed.
            keras_ft.NonFiniteStateError: if its writer refused a state
                that was not finite (`async_save`); nothing was committed.
        """
        checkpoint = self._parts.queue.wait()
        wait_for_removals()
        return checkpoint

    @property
    def writing(self) -> bool:
        """Whether a save is being written in the background right now."""
        return self._parts.queue.busy

    def raise_if_failed(self) -> None:
        """Raises the error of a background write that failed, without waiting."""
        self._parts.queue.raise_if_failed()

    def prepare(self, copies: bool = True, reuse: CopyBuffer | None = None) -> None:
        """Does the one-time work of the first save now (walking the model,
        laying out the weights file, and with `copies`, allocating the
        buffer snapshots are copied into, in the background), so that no
        save pays for it.

        Args:
            copies: Whether saves are expected (scheduled ones, not only
                a preemption's, which allocates the buffer if it comes).
                Defaults to `True`.
            reuse: The `copy_buffer` of an earlier training of this model
                (the last `fit()`'s, its writes over): used if it holds the
                same file. Defaults to `None`.
        """
        self._state.prepare(copy=copies, reuse=reuse)

    @property
    def copy_buffer(self) -> CopyBuffer | None:
        """The buffer copied snapshots go into, if one was made: hand it to
        the next training of the model (`prepare(reuse=...)`)."""
        return self._state.copy_buffer

    def discard_pending(self) -> None:
        """Calls off the background writes that have not committed yet.

        For a backup about to be deleted: each write stops where it is and
        commits nothing.

        Raises:
            keras_ft.CheckpointWriteError: if one of them had failed before
                it was called off (a failed write is never silently lost).
        """
        self._parts.queue.discard_pending()

    @property
    def fit_number(self) -> int | None:
        """Which `fit()` of the process this training is, where several
        share the backup: a backup a later one wrote is not loaded (its
        `ResumePoint.later_fit` says so). `None` (the default): not
        counted; the newest backup is loaded whoever wrote it."""
        return self._state.fit_number

    @fit_number.setter
    def fit_number(self, value: int | None) -> None:
        self._state.fit_number = value

    def restore(self) -> ResumePoint | None:
        """Loads the newest good checkpoint into the model.

        Returns:
            Where training resumes, or `None` if there is no backup.

        Raises:
            keras_ft.NoGoodCheckpointError: if every checkpoint is damaged.
            ValueError: if the backup does not match the model.
        """
        self._parts.queue.finish()
        self._state.configuration()  # As set up, before anything is loaded.
        point = self._load_newest(variables_only=False)
        if point is not None and point.later_fit is None and point.config_changes:
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
        point = self._parts.tiers.load_newest(
            self._state, variables_only, self.on_config_change == "raise"
        )
        if point is not None and point.later_fit is None:
            notify(
                self.listeners,
                "after_restore",
                point.checkpoint,
                point.epoch,
                point.step,
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
        return self._parts.store.checkpoints()

    def delete_backup(self) -> None:
        """Deletes what this backup wrote; other files in `backup_dir` stay."""
        self._parts.queue.wait()
        self._parts.claim.delete()
        self._parts.tiers.clear_local()  # Every process's own.
        # `backup_dir` itself, if nothing else is in it.
        self._parts.root.housekeeping.remove_root()
        self._parts.queue.release()
