"""One save on its way through the writer (`keras_ft/saves/save.py`): the
record's files written, the checkpoint of the save it supersedes, and a
snapshot that is not finite refused before anything beside its weights is
written. Through whole trainings: `test_worker_training_state.py`."""

from __future__ import annotations

import os
import threading

import keras
import numpy as np
import pytest
from conftest import make_model, weights_of

from keras_ft import threads
from keras_ft.checkpoint.files import Staging
from keras_ft.checkpoint.format import Checkpoint
from keras_ft.errors import NonFiniteStateError, SaveCancelled
from keras_ft.saves.save import Save, write_snapshot
from keras_ft.state import WEIGHTS_FILE, TrainingState, arrays


def trained_model(units: int = 8) -> keras.Model:
    model = make_model(units)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    return model


def test_a_save_writes_its_snapshot_files_that_load_back(tmp_path):
    model = trained_model()
    state = TrainingState(model)
    snapshot = state.snapshot(1, 0, {"note": np.arange(3)})
    staging = tmp_path / "staging"
    staging.mkdir()
    Save(snapshot).write_files(Staging(str(staging)))
    assert sorted(os.listdir(staging)) == sorted([WEIGHTS_FILE, arrays.ARRAYS_FILE])
    fresh = make_model(8)
    TrainingState(fresh).apply(str(staging), snapshot.metadata)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_save_with_a_writer_of_its_own_writes_only_that(tmp_path):
    written = []

    class Files:  # A layout of its own (as a sharded save's parts).
        def write(self, staging):
            written.append(staging)

    save = Save(None, files=Files())
    staging = Staging(str(tmp_path))
    save.write_files(staging)
    assert written == [staging] and os.listdir(tmp_path) == []


def test_the_save_superseded_is_known_once_its_write_is_over():
    assert Save(None).superseded() is None
    gate = threading.Event()
    checkpoint = Checkpoint(3, "/backup/ckpt-00000003")

    def commit():
        assert gate.wait(10)
        return checkpoint

    with threads.BackgroundWriter() as writer:
        save = Save(None, replaced=writer.submit(commit))
        threading.Timer(0.2, gate.set).start()
        assert save.superseded() == checkpoint  # Waited for it.


def test_a_superseded_save_called_off_committed_nothing():
    def called_off():
        raise threads.Cancelled("called off")

    with threads.BackgroundWriter() as writer:
        assert Save(None, replaced=writer.submit(called_off)).superseded() is None


@pytest.mark.parametrize("later", [True, False], ids=["checked later", "in the copy"])
def test_a_snapshot_that_is_not_finite_is_refused_after_its_weights(tmp_path, later):
    """Checked after the copy, the writer names the variable and the point;
    checked during it, the save was already refused in the training thread,
    and the write only stops. Either way no other file is written."""
    model = trained_model()
    variable = model.trainable_variables[0]
    variable.assign(keras.ops.full(variable.shape, float("nan")))
    snapshot = TrainingState(model).snapshot(2, 5, fill=False, check_later=later)
    snapshot.weights.fill()
    staging = tmp_path / "staging"
    staging.mkdir()
    if later:
        with pytest.raises(NonFiniteStateError, match="epoch 3, batch 5"):
            write_snapshot(snapshot, str(staging))
    else:
        with pytest.raises(SaveCancelled):
            write_snapshot(snapshot, str(staging))
    assert os.listdir(staging) == [WEIGHTS_FILE]  # Never committed.
