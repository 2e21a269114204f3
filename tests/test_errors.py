"""keras-ft's errors (`keras_ft/errors.py`): what each is also (so that code
catching the standard error catches it), and what its message says. Where
each is raised: the tests of the modules that raise it."""

from __future__ import annotations

import pickle

import pytest
from conftest import run_once_on

import keras_ft
from keras_ft import errors, threads

ONCE = run_once_on("torch", "plain exceptions; the backend does not matter")


@ONCE
@pytest.mark.parametrize(
    "error, also",
    [
        (errors.CheckpointWriteError, (OSError, errors.CheckpointError)),
        (errors.LeaseLapsedError,
         (errors.CheckpointWriteError, errors.DirectoryInUseError, OSError)),
        (errors.DirectoryInUseError, (RuntimeError,)),
        (errors.SaveCancelled, (threads.Cancelled, errors.CheckpointError)),
        (errors.ConfigurationChangedError, (ValueError,)),
        (errors.CompatibilityWarning, (UserWarning,)),
        (errors.CorruptCheckpointError, (errors.CheckpointError,)),
        (errors.NoGoodCheckpointError, (errors.CheckpointError,)),
        (errors.ProcessesDisagreeError, (errors.CheckpointError,)),
        (errors.NonFiniteStateError, (errors.CheckpointError,)),
    ],
)  # fmt: skip
def test_each_error_is_also_the_standard_one_it_stands_for(error, also):
    assert issubclass(error, also)
    if error.__name__ in keras_ft.__all__:  # Else raised to no user.
        assert getattr(keras_ft, error.__name__) is error


@ONCE
def test_a_write_error_carries_its_errno():
    import errno

    error = errors.LeaseLapsedError(errno.EBUSY, "lease taken")
    assert error.errno == errno.EBUSY and "lease taken" in str(error)


@ONCE
def test_a_damaged_checkpoint_names_itself_and_why():
    error = errors.CorruptCheckpointError("/b/chief/ckpt-00000003", "size mismatch")
    assert str(error) == "Checkpoint /b/chief/ckpt-00000003 is damaged: size mismatch"
    assert (error.path, error.reason) == ("/b/chief/ckpt-00000003", "size mismatch")


@ONCE
@pytest.mark.parametrize(
    "variables, at, shown",
    [
        (["dense/kernel"], None, "(dense/kernel hold NaN or infinity), so this state"),
        (["a", "b", "c", "d", "e"], "epoch 2, batch 30",
         "(a, b, c and 2 more hold NaN or infinity), so the state at epoch 2, "
         "batch 30 was not"),
    ],
)  # fmt: skip
def test_a_state_not_finite_names_three_values_and_counts_the_rest(
    variables, at, shown
):
    error = errors.NonFiniteStateError(variables, at)
    assert shown in str(error) and "the previous backup is kept" in str(error)
    assert error.variables == variables and error.at == at


@ONCE
@pytest.mark.parametrize("count, more", [(1, ""), (5, ""), (8, "; and 3 more")])
def test_a_configuration_change_names_five_differences(count, more):
    changes = [f"optimizer.learning_rate[{i}]: 0.1 then 0.2" for i in range(count)]
    error = errors.ConfigurationChangedError("/b", changes)
    text = str(error)
    assert text.startswith("The backup in /b was written by a training configured")
    assert text.count("then 0.2") == min(count, 5) and text.endswith(
        "`on_config_change='warn'` to continue the backup's training with this "
        "configuration."
    )
    assert (more in text) if more else "more" not in text
    assert error.changes == changes


@ONCE
def test_a_configuration_the_variables_do_not_fit_says_it_cannot_continue():
    error = errors.ConfigurationChangedError(
        "/b", ["model.layers[0].units: 8 then 9"], unfit="kernel has shape (4, 8)"
    )
    assert "do not fit this configuration (kernel has shape (4, 8))" in str(error)
    assert "on_config_change='warn'" not in str(error)


@ONCE
def test_errors_cross_process_boundaries():
    """Raised in a worker thread or process and re-raised here: each error
    survives pickling with its message."""
    for error in (
        errors.CorruptCheckpointError("/b/ckpt", "truncated"),
        errors.NonFiniteStateError(["w"], "epoch 1, batch 2"),
        errors.ConfigurationChangedError("/b", ["x: 1 then 2"], unfit="shape"),
        errors.CheckpointWriteError(28, "No space left"),
        errors.LeaseLapsedError(16, "lease taken"),
        errors.NoGoodCheckpointError("every checkpoint is damaged"),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert vars(again) == vars(error)
