"""`keras_ft/saves/chief.py`: the chief's save, copied while training waits,
written and committed by the writer thread, the listeners told around it."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from conftest import iterations, locked_training, make_model, weights_of

import keras_ft
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.errors import NonFiniteStateError


class Told(keras_ft.CheckpointListener):
    def __init__(self):
        self.calls = []

    def before_save(self, epoch, step):
        self.calls.append(("before_save", epoch, step))

    def after_commit(self, path, epoch, step):
        self.calls.append(("after_commit", os.path.basename(path), epoch, step))


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_is_committed_in_order_and_the_listeners_told(tmp_path, async_save):
    backup_dir = str(tmp_path / "backup")
    told = Told()
    state = locked_training(backup_dir, listeners=[told], async_save=async_save)
    chief, step = state._parts.chief, iterations(state.model)
    try:
        chief.back_up(1, 0, None, replaces_last=False, to_bucket=True)
        chief.back_up(1, 2, None, replaces_last=False, to_bucket=True)
        state._parts.queue.wait()
    finally:
        state.close()
    # Each save is announced before its copy, and its commit told in order
    # (an asynchronous save's commit may come after the next one's start).
    commits = [c for c in told.calls if c[0] == "after_commit"]
    assert commits == [
        ("after_commit", "ckpt-00000001", 1, step),
        ("after_commit", "ckpt-00000002", 1, step),
    ]
    assert told.calls[0] == ("before_save", 1, step)
    assert told.calls.count(("before_save", 1, step)) == 2
    second = told.calls.index(("before_save", 1, step), 1)
    assert told.calls.index(commits[1]) > second
    if not async_save:
        assert told.calls.index(commits[0]) < second
    store = CheckpointStore(os.path.join(backup_dir, "chief"))
    assert [c.name for c in store.checkpoints()] == ["ckpt-00000001", "ckpt-00000002"]
    fresh = make_model()
    loaded = keras_ft.load_checkpoint(backup_dir, fresh)
    assert (loaded.epoch, loaded.batch) == (1, 2)
    for mine, theirs in zip(weights_of(fresh), weights_of(state.model), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_a_save_that_replaces_the_last_leaves_only_itself(tmp_path):
    backup_dir = str(tmp_path / "backup")
    state = locked_training(backup_dir, keep=5)
    try:
        state._parts.chief.back_up(1, 0, None, replaces_last=False, to_bucket=True)
        state._parts.chief.back_up(1, 3, None, replaces_last=True, to_bucket=True)
        state._parts.queue.wait()
    finally:
        state.close()
    store = CheckpointStore(os.path.join(backup_dir, "chief"))
    [kept] = store.checkpoints()
    assert kept.name == "ckpt-00000002"
    assert keras_ft.load_checkpoint(backup_dir, make_model()).batch == 3


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_state_not_finite_commits_nothing(tmp_path, async_save):
    backup_dir = str(tmp_path / "backup")
    state = locked_training(backup_dir, async_save=async_save)
    kernel = state.model.layers[0].kernel
    kernel.assign(keras.ops.full(kernel.shape, float("inf")))
    try:
        # Checked during the copy (sync), or by the writer, which then
        # raises at the next look (async): either way, named.
        with pytest.raises(NonFiniteStateError, match="dense"):
            state._parts.chief.back_up(1, 0, None, replaces_last=False, to_bucket=True)
            state._parts.queue.wait()
    finally:
        state.close()
    assert CheckpointStore(os.path.join(backup_dir, "chief")).checkpoints() == []
