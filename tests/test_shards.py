"""`keras_ft/saves/shards.py`: a save of a model split across processes,
made here by one process (its share is every variable). Real clusters of
JAX processes: `test_sharded.py`."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from conftest import iterations, locked_training, make_model, weights_of

import keras_ft
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.errors import NonFiniteStateError


def test_a_process_share_is_committed_as_its_part_and_restores(tmp_path):
    backup_dir = str(tmp_path / "backup")
    state = locked_training(backup_dir)
    try:
        state._parts.sharded.back_up(1, 0, None, replaces_last=False, to_bucket=False)
        state._parts.queue.wait()
    finally:
        state.close()
    store = CheckpointStore(os.path.join(backup_dir, "chief"))
    [committed] = store.checkpoints()
    store.verify(committed)
    assert "shards-00000.bin" in os.listdir(committed.path)
    # No part of the save is left beside the checkpoint.
    assert [n for n in os.listdir(store.directory) if n.startswith(".parts")] == []
    fresh = make_model()
    loaded = keras_ft.load_checkpoint(backup_dir, fresh)
    assert loaded.epoch == 1 and iterations(fresh) == iterations(state.model)
    for mine, theirs in zip(weights_of(fresh), weights_of(state.model), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_a_share_not_finite_is_refused_and_nothing_is_committed(tmp_path):
    backup_dir = str(tmp_path / "backup")
    state = locked_training(backup_dir)
    try:
        kernel = state.model.layers[0].kernel
        kernel.assign(keras.ops.full(kernel.shape, float("nan")))
        with pytest.raises(NonFiniteStateError, match="kernel"):
            state._parts.sharded.back_up(
                1, 0, None, replaces_last=False, to_bucket=False
            )
        state._parts.queue.wait()
    finally:
        state.close()
    assert CheckpointStore(os.path.join(backup_dir, "chief")).checkpoints() == []
