"""How each backend's `fit()` loop calls `train_function`
(`keras_ft/backend/fit_loop.py`): a skipped step pulls what the real one
would and returns what the loop expects. Resumes that skip steps:
`test_exact_resume.py`, `test_inputs.py`."""

from __future__ import annotations

import keras

from keras_ft.backend import fit_loop

BACKEND = keras.backend.backend()


def call_args(iterator) -> tuple:
    """`train_function`'s arguments, as this backend's loop passes them."""
    if BACKEND == "tensorflow":
        return (iterator,)
    if BACKEND == "jax":
        return ("trainer state", iterator)
    return ("the batch the loop pulled",)


def test_a_skipped_step_pulls_its_batches_and_returns_what_the_loop_expects():
    iterator = iter(range(10))
    logs = {"loss": 0.5}
    result, batches, pulled_from = fit_loop.skipped_step(call_args(iterator), logs, 3)
    if BACKEND == "torch":  # The loop pulled the batch already.
        assert (result, batches, pulled_from) == (logs, [], None)
        assert fit_loop.loop_pulls_batches()
        return
    assert batches == [0, 1, 2] and pulled_from is iterator and next(iterator) == 3
    # JAX's train_function returns the logs and the state it was given.
    assert result == ((logs, "trainer state") if BACKEND == "jax" else logs)
    assert not fit_loop.loop_pulls_batches()


def test_a_step_the_input_skipped_at_its_source_pulls_nothing():
    iterator = iter(range(10))
    _, batches, _ = fit_loop.skipped_step(call_args(iterator), {}, 3, pull=False)
    assert batches == []
    assert next(iterator) == 0


def test_an_iterator_that_runs_out_gives_what_it_had():
    iterator = iter(range(2))
    _, batches, _ = fit_loop.skipped_step(call_args(iterator), {}, 5)
    assert batches == ([] if BACKEND == "torch" else [0, 1])
