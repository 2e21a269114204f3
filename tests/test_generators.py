"""The data side's global generators as a backup holds them
(`keras_ft/state/generators.py`): checked before any is set, and restored
to draw what they would have drawn. Whole restores: `test_rng.py`."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from conftest import run_once_on

from keras_ft.state import generators, rng

ONCE = run_once_on("torch", "Python's and NumPy's generators alone")


def saved_after_draws(seed: int) -> dict:
    random.seed(seed)
    np.random.seed(seed)
    random.gauss(0, 1)  # A cached Gaussian in Python's state.
    np.random.standard_normal()  # And one in NumPy's.
    return rng.from_raw(rng.capture_raw())


@ONCE
def test_a_saved_state_draws_what_the_generators_would_have():
    saved = saved_after_draws(7)
    expected = ([random.random() for _ in range(5)], np.random.random(5))
    generators.check(saved)
    python, numpy = random.Random(), np.random.RandomState()
    python.setstate(generators.python_state(saved["python"]))
    numpy.set_state(generators.numpy_state(saved["numpy"]))
    assert [python.random() for _ in range(5)] == expected[0]
    np.testing.assert_array_equal(numpy.random_sample(5), expected[1])


@ONCE
def test_checking_changes_no_global_generator():
    saved = saved_after_draws(7)
    random.seed(1)
    np.random.seed(1)
    before = random.getstate(), np.random.get_state()[1].copy()
    generators.check(saved)
    assert random.getstate() == before[0]
    np.testing.assert_array_equal(np.random.get_state()[1], before[1])


def damaged(change) -> dict:
    saved = copy.deepcopy(saved_after_draws(3))
    change(saved)
    return saved


@ONCE
@pytest.mark.parametrize(
    "state, named",
    [
        (damaged(lambda s: s["numpy"].update(pos=625)), "position"),
        (damaged(lambda s: s["numpy"].update(pos=-1)), "position"),
        (damaged(lambda s: s["numpy"].update(pos=True)), "position"),
        (damaged(lambda s: s["numpy"].update(keys=np.zeros(3, np.uint32))), "keys"),
        (damaged(lambda s: s["numpy"].update(keys=np.zeros(624))), "keys"),
        (damaged(lambda s: s["numpy"].pop("name")), "malformed"),
        (damaged(lambda s: s["numpy"].update(name="PCG64")), "malformed"),
        (damaged(lambda s: s["python"].__setitem__(1, np.zeros(3))), "malformed"),
        (
            damaged(lambda s: s["python"].__setitem__(1, np.zeros(625, float))),
            "vector of integers",
        ),  # fmt: skip
        (damaged(lambda s: s["python"].__setitem__(2, "0.5")), "Gaussian"),
        (damaged(lambda s: s.__setitem__("python", [3])), "malformed"),
        ([1, 2], "not an object"),
    ],
)
def test_a_damaged_state_is_refused_before_any_is_set(state, named):
    random.seed(5)
    before = random.getstate()
    with pytest.raises(ValueError, match=named):
        generators.check(state)
    assert random.getstate() == before


@ONCE
def test_a_state_of_only_one_generator_is_checked_alone():
    saved = saved_after_draws(2)
    generators.check({"numpy": saved["numpy"]})
    generators.check({"python": saved["python"]})
    generators.check({})
