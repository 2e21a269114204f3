"""`backend/finiteness.py`: the one place that decides whether a state, or a
logged number, holds a NaN or an infinity."""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest

from keras_ft.backend import finiteness

BAD = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("value", [0.5, 3, np.float32(2.0), "n/a", None, [1.0]])
def test_a_finite_or_non_numeric_logged_value_is_finite(value):
    """What is not a number at all has nothing to refuse."""
    assert finiteness.finite_number(value)


@pytest.mark.parametrize("value", [*BAD, np.float32("nan"), "inf"])
def test_a_non_finite_logged_value_is_not(value):
    assert not finiteness.finite_number(value)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", ml_dtypes.bfloat16])
def test_a_host_array_with_one_bad_value_is_not_finite(dtype):
    array = np.linspace(-1, 1, 1000).astype(dtype)
    assert finiteness.all_finite(array)
    for bad in BAD:
        spoiled = array.copy()
        spoiled[517] = bad
        assert not finiteness.all_finite(spoiled), (dtype, bad)
    both = array.copy()
    both[[3, 900]] = [np.inf, -np.inf]  # Their sum is NaN.
    assert not finiteness.all_finite(both)


@pytest.mark.filterwarnings("error")
def test_a_host_array_whose_sum_overflows_is_still_finite():
    """The fast path sums (float16 in float32): an overflowing sum of finite
    values takes the exact check, not a refusal, and NumPy says nothing."""
    array = np.full(100, 3e38, dtype="float32")
    with np.errstate(over="ignore"):
        assert np.isinf(array.sum())
    assert finiteness.all_finite(array)
    assert finiteness.all_finite(np.arange(10))  # Integers always are.


def test_values_on_the_device_are_checked_where_they_live():
    good = [
        keras.Variable(np.ones((8, 4), "float32")),
        keras.Variable(np.arange(3), trainable=False),
    ]
    assert finiteness.device_all_finite(good)
    assert finiteness.finite_flag([good[1]]) is None  # Nothing floating.
    bad = np.ones((8, 4), "float32")
    bad[3, 2] = np.nan
    assert not finiteness.device_all_finite([*good, keras.Variable(bad)])
    assert not bool(finiteness.finite_flag([keras.Variable(bad)]))


def test_an_overflowing_sum_on_the_device_is_still_finite():
    """PyTorch's flag sums each value (in float32): exact where it fails."""
    big = keras.Variable(np.full((4, 4), 3e38, "float32"))
    assert finiteness.device_all_finite([big])
