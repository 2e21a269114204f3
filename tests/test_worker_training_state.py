"""WorkerTrainingState on its own, as a custom training loop would use it."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import iterations, make_model, tree_digest, weights_of

from keras_ft import TaskSpec, WorkerTrainingState


def train_epochs(model, data, first, last, state):
    x, y = data
    for epoch in range(first, last):
        for i in range(0, len(x), 16):
            model.train_on_batch(x[i : i + 16], y[i : i + 16])
        state.back_up(epoch)


def test_custom_loop_backs_up_and_resumes(backup_dir, data):
    model = make_model()
    state = WorkerTrainingState(model, backup_dir)
    assert state.restore() is None
    train_epochs(model, data, 0, 3, state)
    assert [c.sequence for c in state.checkpoints()] == [2, 3]  # keep=2

    fresh = make_model()
    resume = WorkerTrainingState(fresh, backup_dir).restore()
    assert (resume.epoch, resume.batch, resume.step) == (3, 0, 12)
    assert resume.checkpoint.endswith(os.path.join("chief", "ckpt-00000003"))
    assert iterations(fresh) == 12
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_mid_epoch_back_up_records_the_batch(backup_dir, data):
    model = make_model()
    model.train_on_batch(*[a[:16] for a in data])
    state = WorkerTrainingState(model, backup_dir)
    state.back_up(4, batch=1)
    resume = WorkerTrainingState(make_model(), backup_dir).restore()
    assert (resume.epoch, resume.batch, resume.step) == (4, 1, 1)


def test_delete_backup_keeps_other_files(backup_dir, data):
    os.makedirs(backup_dir)
    with open(os.path.join(backup_dir, "my_notes.txt"), "w") as f:
        f.write("keep me")
    state = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(state.model, data, 0, 1, state)
    state.delete_backup()
    assert os.listdir(backup_dir) == ["my_notes.txt"]


def test_delete_backup_removes_a_directory_it_emptied(backup_dir, data):
    state = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(state.model, data, 0, 1, state)
    state.delete_backup()
    assert not os.path.exists(backup_dir)


def test_non_chief_writes_a_temporary_directory_and_removes_it(backup_dir, data):
    chief = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(chief.model, data, 0, 1, chief)
    before = tree_digest(backup_dir)

    worker_model = make_model()
    worker = WorkerTrainingState(
        worker_model, backup_dir, task=TaskSpec("worker", 1, 2, False)
    )
    written = []
    original_snapshot = worker._state.snapshot

    def spy(*args):
        snapshot = original_snapshot(*args)
        original_write = snapshot.write

        def write(directory):
            written.append(directory)
            original_write(directory)

        snapshot.write = write
        return snapshot

    worker._state.snapshot = spy
    assert worker.back_up(0) is None
    assert written and os.path.join(backup_dir, "workertemp_1") in written[0]
    assert not os.path.exists(os.path.join(backup_dir, "workertemp_1"))
    assert tree_digest(backup_dir) == before  # The chief's files are untouched.
    # Every worker restores from the chief's checkpoint.
    assert worker.restore().epoch == 1
    worker.delete_backup()
    assert tree_digest(backup_dir) == before


def test_check_writable_names_backup_dir(unwritable_dir):
    state = WorkerTrainingState(make_model(), os.path.join(unwritable_dir, "b"))
    with pytest.raises(ValueError, match="`backup_dir`.*cannot write"):
        state.check_writable()


def test_check_writable_removes_a_killed_writers_staging_directory(backup_dir):
    staging = os.path.join(backup_dir, "chief", ".staging-00000001-999-abcd")
    os.makedirs(staging)
    WorkerTrainingState(make_model(), backup_dir).check_writable()
    assert not os.path.exists(staging)
