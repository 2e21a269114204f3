"""`BackupOptions`: a training's backup options, checked once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import make_model, run_once_on

import keras_ft
from keras_ft import options as options_module

ONCE = run_once_on("torch", "argument checks; the backend does not matter")


@ONCE
@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"backup_dir": ""}, "Empty `backup_dir`"),
        ({"keep": 0}, "keep=0"),
        ({"on_config_change": "ignore"}, "on_config_change='ignore'"),
        ({"snapshot": "gpu"}, "snapshot='gpu'"),
        ({"storage_options": "key=1"}, "storage_options='key=1'"),
        ({"local_dir": "/tmp/tier"}, "local_dir="),  # Only before a bucket.
        ({"manifest_key": 3}, "manifest_key"),
    ],
)
def test_each_option_is_checked_when_made(tmp_path, arguments, named):
    arguments = {"backup_dir": str(tmp_path / "backup"), **arguments}
    with pytest.raises(ValueError, match=named):
        keras_ft.BackupOptions(**arguments)
    assert not (tmp_path / "backup").exists()


@ONCE
def test_options_are_normalized_and_frozen(tmp_path):
    options = keras_ft.BackupOptions(tmp_path / "backup", async_save=1)
    assert options.backup_dir == str(tmp_path / "backup")
    assert options.async_save is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.keep = 5


@ONCE
def test_a_worker_training_state_takes_the_options_whole(tmp_path, data):
    options = keras_ft.BackupOptions(str(tmp_path / "backup"), keep=3)
    model = make_model()
    state = keras_ft.WorkerTrainingState(model, options)
    assert state.options is options and state.backup_dir == options.backup_dir
    with state.locked():
        assert state.restore() is None
    for epoch in range(4):
        model.fit(*data, epochs=1, batch_size=16, verbose=0)
        state.back_up(epoch)
    assert len(state.checkpoints()) == 3  # `keep` from the options.
    saved = [np.array(v) for v in model.weights]
    state.close()

    other = make_model()
    again = keras_ft.WorkerTrainingState(other, options)
    with again.locked():
        assert again.restore().epoch == 4
    for mine, theirs in zip(other.weights, saved, strict=True):
        np.testing.assert_array_equal(np.array(mine), theirs)
    again.close()


@ONCE
def test_options_and_the_same_arguments_are_refused_together(tmp_path):
    options = keras_ft.BackupOptions(str(tmp_path / "backup"))
    with pytest.raises(ValueError, match="keep.*Pass either the options"):
        keras_ft.WorkerTrainingState(make_model(), options, keep=3)


def test_the_callback_checks_its_options_once_for_every_fit(
    tmp_path, data, monkeypatch
):
    """Made when the callback is: each fit()'s `WorkerTrainingState` takes
    them whole (a bucket's filesystem is opened once, not per fit)."""
    made = []
    post_init = options_module.BackupOptions.__post_init__

    def counted(self):
        made.append(self.backup_dir)
        post_init(self)

    monkeypatch.setattr(options_module.BackupOptions, "__post_init__", counted)
    callback = keras_ft.BackupAndRestore(
        str(tmp_path / "backup"), keep=1, double_checkpoint=True
    )
    assert callback.options.keep == 2  # Keras' two files: two checkpoints.
    made.clear()
    model = make_model()
    for _ in range(2):
        model.fit(*data, epochs=1, batch_size=16, verbose=0, callbacks=[callback])
    assert made == []
