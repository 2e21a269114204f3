"""`BackupOptions` and `FitOptions`: a training's options, checked once."""

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
        # A string is not a flag: "False" would count as true.
        ({"async_save": "False"}, "async_save='False'"),
        ({"verbose": "0"}, "verbose='0'"),
        ({"verbose": -1}, "verbose=-1"),
    ],
)
def test_each_option_is_checked_when_made(tmp_path, arguments, named):
    arguments = {"backup_dir": str(tmp_path / "backup"), **arguments}
    with pytest.raises(ValueError, match=named):
        keras_ft.BackupOptions(**arguments)
    assert not (tmp_path / "backup").exists()


@ONCE
def test_options_are_normalized_and_frozen(tmp_path):
    options = keras_ft.BackupOptions(
        tmp_path / "backup", async_save=1, verbose=np.bool_(True)
    )
    assert options.backup_dir == str(tmp_path / "backup")
    assert options.async_save is True and options.verbose == 1
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


@ONCE
@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"save_freq": 0}, "save_freq=0"),
        ({"save_freq": "batch"}, "save_freq='batch'"),
        ({"overhead_budget": 2}, "overhead_budget"),
        ({"save_every_seconds": -1}, "save_every_seconds=-1"),
        ({"on_save_error": "ignore"}, "on_save_error='ignore'"),
        ({"preemption_signals": ("SIGNOPE",)}, "SIGNOPE"),
        ({"grace_period": 0}, "grace_period=0"),
        ({"warm_start": 3}, "warm_start"),
        ({"listeners": [object()]}, "listeners"),
        ({"local_save_freq": 5}, "local_dir` is None"),
        ({"local_dir": "/tier", "local_save_freq": 0}, "local_save_freq=0"),
        ({"stall_timeout": -5}, "stall_timeout"),
        ({"first_batch_timeout": 0}, "first_batch_timeout"),
        ({"goodput_file": 7}, "goodput_file=7"),
        ({"delete_checkpoint": "no"}, "delete_checkpoint='no'"),
        ({"double_checkpoint": None}, "double_checkpoint=None"),
        ({"exit_on_preemption": 2}, "exit_on_preemption=2"),
    ],
)
def test_each_fit_option_is_checked_when_made(arguments, named):
    with pytest.raises(ValueError, match=named):
        options_module.FitOptions(**arguments)


@ONCE
def test_fit_options_are_normalized_and_the_callback_shows_them(tmp_path):
    import signal

    fit = options_module.FitOptions(
        save_freq=False, preemption_signals="SIGUSR1", grace_period=3,
        exit_on_preemption=0, first_batch_timeout=60,
    )  # fmt: skip
    assert fit.preemption_signals == (signal.SIGUSR1,)
    assert fit.grace_period == 3.0 and fit.first_batch_timeout == 60.0
    assert fit.exit_on_preemption is False and fit.listeners == ()
    assert not fit.backs_up_stopped_epochs  # Only preemption saves asked for.
    with pytest.raises(dataclasses.FrozenInstanceError):
        fit.save_freq = 3
    # Each call: new schedules, so that one fit()'s counts are not another's.
    assert fit.schedules()[0] is not fit.schedules()[0]

    callback = keras_ft.BackupAndRestore(
        str(tmp_path / "backup"), save_freq=4, keep=3, exit_on_preemption=0
    )
    assert callback.fit_options.save_freq == callback.save_freq == 4
    assert callback.keep == 3 and callback.exit_on_preemption is False
    assert callback.fit_options.backs_up_stopped_epochs
