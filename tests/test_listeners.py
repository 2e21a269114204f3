"""Checkpoint listeners: told around every save and restore; never in the way."""

from __future__ import annotations

import threading

import pytest
from conftest import STEPS_PER_EPOCH, make_model

import keras_ft
from keras_ft.checkpoint.store import CheckpointStore


class Recorder(keras_ft.CheckpointListener):
    def __init__(self):
        self.calls: list[tuple] = []
        self.verified: list[bool] = []
        self.threads: list[str] = []

    def before_save(self, epoch, step):
        self.calls.append(("before_save", epoch, step))

    def after_commit(self, path, epoch, step):
        self.calls.append(("after_commit", epoch, step))
        self.threads.append(threading.current_thread().name)
        store = CheckpointStore(path.rsplit("/", 1)[0])
        checkpoint = next(c for c in store.checkpoints() if c.path == path)
        self.verified.append(bool(store.verify(checkpoint)))

    def after_restore(self, path, epoch, step):
        self.calls.append(("after_restore", epoch, step))


@pytest.mark.parametrize("async_save", [True, False])
def test_listeners_are_told_before_after_commit_and_after_restore(
    backup_dir, data, async_save
):
    x, y = data
    recorder = Recorder()

    def callback():
        return keras_ft.BackupAndRestore(
            backup_dir, async_save=async_save, listeners=[recorder],
            delete_checkpoint=False,
        )  # fmt: skip

    make_model().fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[callback()])
    steps = STEPS_PER_EPOCH
    # With async saves, a commit may come after the next save began.
    assert [c for c in recorder.calls if c[0] == "before_save"] == [
        ("before_save", 1, steps),
        ("before_save", 2, 2 * steps),
    ]
    assert [c for c in recorder.calls if c[0] == "after_commit"] == [
        ("after_commit", 1, steps),
        ("after_commit", 2, 2 * steps),
    ]
    assert recorder.calls.index(("before_save", 1, steps)) < recorder.calls.index(
        ("after_commit", 1, steps)
    )
    # Each commit was complete and verified when the listener looked, from
    # the writer's thread (fit() waits for it with async_save=False).
    assert recorder.verified == [True, True]
    main = threading.main_thread().name
    assert all(name != main for name in recorder.threads)

    recorder.calls.clear()
    make_model().fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[callback()])
    assert recorder.calls[0] == ("after_restore", 2, 2 * steps)
    assert recorder.calls[-1] == ("after_commit", 3, 3 * steps)


class Raises(keras_ft.CheckpointListener):
    def before_save(self, epoch, step):
        raise RuntimeError("before_save went wrong")

    def after_commit(self, path, epoch, step):
        raise OSError("the archive copy went wrong")


@pytest.mark.parametrize("async_save", [True, False])
def test_a_listener_that_raises_leaves_a_good_checkpoint(backup_dir, data, async_save):
    x, y = data
    with pytest.warns(UserWarning, match="the archive copy went wrong") as caught:
        make_model().fit(
            x, y, epochs=2, batch_size=16, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(
                backup_dir, listeners=[Raises()], async_save=async_save,
                delete_checkpoint=False,
            )],
        )  # fmt: skip
    texts = [str(w.message) for w in caught]
    # Reported with the traceback, each time.
    assert sum("Traceback" in t and "before_save went wrong" in t for t in texts) == 2
    assert sum("Traceback" in t and "OSError" in t for t in texts) == 2
    committed = list(keras_ft.watch(backup_dir, timeout=0))  # Verified.
    assert [c.epoch for c in committed] == [1, 2]
    fresh = make_model()
    assert keras_ft.load_checkpoint(backup_dir, fresh).step == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("listeners", ["print", [object()], 3])
def test_bad_listeners_are_named(backup_dir, listeners):
    with pytest.raises(ValueError, match="Invalid value for argument `listeners`"):
        keras_ft.BackupAndRestore(backup_dir, listeners=listeners)
