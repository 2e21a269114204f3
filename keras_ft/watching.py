"""Following a backup from another process: continuous evaluation.

`tf.train.checkpoints_iterator` and TensorLayer's evaluator for keras-ft
backups: `watch()` yields each checkpoint once it is committed, and
`load_checkpoint()` loads one into a model. Both only read: a watcher never
locks, changes or slows down the training that writes the backup (beyond
the disk reads of checking each checkpoint once), and a checkpoint that the
trainer's retention deletes under it is passed over.

`watch()` needs no Keras; `load_checkpoint()` imports it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from keras_ft import events
from keras_ft.checkpoint.store import (
    Checkpoint,
    CheckpointStore,
    checkpoints_dir,
    locate,
    open_store,
)
from keras_ft.errors import CheckpointError, CorruptCheckpointError
from keras_ft.state import contents
from keras_ft.training.policy import check_seconds

if TYPE_CHECKING:
    import keras


def watch(
    backup_dir: str | os.PathLike,
    timeout: float | None = None,
    poll_seconds: float = 1.0,
    storage_options: dict | None = None,
    timeout_fn: Callable[[], bool] | None = None,
) -> Iterator[Checkpoint]:
    """Yields each checkpoint of a backup as it is committed, oldest first.

    Those already there come first, then each new one, exactly once and in
    the order they were committed. A partial checkpoint is never seen (only
    a commit gives one its name), and each is verified against its
    checksums before it is yielded: a damaged one is skipped with a warning.
    One the trainer's retention deleted before it could be checked is
    passed over; keep more (`BackupAndRestore(keep=...)`) if the watcher
    must see every one.

    Example:

    ```python
    for checkpoint in keras_ft.watch("/tmp/backup", timeout=600):
        keras_ft.load_checkpoint(checkpoint, eval_model)
        print(checkpoint.step, eval_model.evaluate(x_val, y_val))
    ```

    Args:
        backup_dir: The `backup_dir` of a `keras_ft.BackupAndRestore`. It
            need not exist yet.
        timeout: Seconds to wait for a new checkpoint before the iteration
            ends; `None` to wait for ever. Defaults to `None`.
        poll_seconds: How often to look for a new checkpoint. Defaults to
            `1.0`.
        storage_options: For a `backup_dir` in object storage (an fsspec
            URL), options for its filesystem. Defaults to `None`.
        timeout_fn: Called each time `timeout` seconds pass without a new
            checkpoint: if it returns `True` (say, the trainer has exited),
            the iteration ends; else it waits another `timeout`. As in
            `tf.train.checkpoints_iterator`. Defaults to `None`: the
            iteration ends at the first timeout.
    """
    check_seconds("poll_seconds", poll_seconds)
    if timeout_fn is not None and not callable(timeout_fn):
        raise ValueError(
            "Invalid value for argument `timeout_fn`: expected a function "
            "taking no arguments that returns whether to stop waiting. "
            f"Received: timeout_fn={timeout_fn!r}"
        )
    if timeout is not None:
        check_seconds("timeout", timeout, zero=True)
    # Verified as a restore would: checksums, then what the files hold.
    store = CheckpointStore(
        checkpoints_dir(os.fspath(backup_dir)),
        storage_options=storage_options,
        inspect=contents.inspect,
    )
    last = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for checkpoint in store.checkpoints():
            if checkpoint.sequence <= last:
                continue
            last = checkpoint.sequence
            try:
                metadata = store.verify(checkpoint)
            except CorruptCheckpointError as e:
                if checkpoint in store.checkpoints():
                    events.warn(
                        "restore", f"keras_ft.watch: skipping {e}.", stacklevel=2
                    )
                continue  # Else deleted by retention while it was checked.
            yield _committed(checkpoint, metadata)
            if timeout is not None:
                deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() >= deadline:
            if timeout_fn is None or timeout_fn():
                return
            deadline = time.monotonic() + timeout
        time.sleep(poll_seconds)


def load_checkpoint(
    checkpoint: Checkpoint | str | os.PathLike,
    model: keras.Model,
    storage_options: dict | None = None,
) -> Checkpoint:
    """Loads a checkpoint's model (and optimizer) variables into `model`.

    The model must be built the same way as the one trained (the same
    layers; compiled or not: an optimizer's state is loaded only into a
    model that has one). The checkpoint's checksums are verified while it
    is read; it is never changed, nor is the backup it belongs to.

    Args:
        checkpoint: What `watch()` yielded, a checkpoint directory
            (`<backup_dir>/chief/ckpt-<n>`), or a `backup_dir`, whose newest
            good checkpoint is loaded.
        model: The model to load into.
        storage_options: For a checkpoint in object storage (an fsspec
            URL), options for its filesystem. Defaults to `None`.

    Returns:
        The checkpoint loaded.

    Raises:
        keras_ft.CorruptCheckpointError: if it does not verify.
        keras_ft.CheckpointError: if it was deleted (e.g. by the trainer's
            retention) before it could be read, or the backup holds none.
        ValueError: if it does not fit the model.
    """
    from keras_ft.state import TrainingState

    state = TrainingState(model)
    found = _checkpoint_at(checkpoint, storage_options)
    if not isinstance(found, tuple):  # A backup: its newest good checkpoint.
        store = found
        latest = store.latest_good_read(
            lambda c, progress: state.read_ahead(c.path, progress, c.ranges)
        )
        if latest is None:
            raise CheckpointError(f"{store.directory} holds no checkpoint to load.")
        local, metadata, values = latest
    else:
        store, wanted = found
        try:
            local, metadata, values = store.fetch(
                wanted, lambda c, progress: state.read_ahead(c.path, progress, c.ranges)
            )
        except CorruptCheckpointError:
            if wanted not in store.checkpoints():
                raise _deleted(wanted) from None
            raise
    try:
        state.apply(
            local.path, metadata, values, variables_only=True, ranges=local.ranges
        )
    except FileNotFoundError:
        # A file not read ahead (the model's layout differs from the
        # trainer's) was gone by the time it was loaded.
        if local not in store.checkpoints():
            raise _deleted(local) from None
        raise
    finally:
        store.release(local)  # A bucket's download: evaluators run for days.
    named = Checkpoint(local.sequence, store.url(local))
    return _committed(named, metadata)


def _deleted(checkpoint: Checkpoint) -> CheckpointError:
    return CheckpointError(
        f"{checkpoint.path} was deleted before it could be loaded (the "
        "trainer's retention let it go). Keep more checkpoints, "
        "`BackupAndRestore(keep=...)`, or load each one sooner."
    )


def _committed(checkpoint: Checkpoint, metadata: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        checkpoint.sequence,
        checkpoint.path,
        epoch=int(metadata.get("epochs_completed", 0)),
        batch=int(metadata.get("batches_completed", 0)),
        step=int(metadata.get("step", 0)),
        saved_at=float(metadata.get("saved_at", 0.0)),
    )


def _checkpoint_at(
    where: Any, storage_options: dict | None
) -> tuple[Any, Checkpoint] | Any:
    """`(store, checkpoint)` for one checkpoint, or the store of a backup."""
    if isinstance(where, Checkpoint):
        parent = where.path.rstrip("/").rpartition("/")[0]
        return open_store(parent, None, storage_options), where
    store, checkpoint = locate(os.fspath(where), storage_options)
    return store if checkpoint is None else (store, checkpoint)
