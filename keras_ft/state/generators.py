"""The data side's global generators (Python's `random`, NumPy's global
`RandomState`) as a backup holds their states: checked, and put in the form
each generator's `setstate()` takes. Needs no Keras: `keras-ft verify` checks
them too.

A backup is untrusted input, and neither generator checks all of what it is
given: NumPy's `set_state()` takes any position, and one past its keys
crashes the process.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

# MT19937's state: this many 32-bit keys, and a position among them.
_MT_KEYS = 624


def check(state: Any) -> None:
    """Raises `ValueError` unless the Python and NumPy states in `state` (a
    saved `rng.capture()`) are ones their generators take: each is set on
    a generator of its own, so no global one changes."""
    if not isinstance(state, dict):
        raise ValueError("a random generator state is not an object")
    try:
        if "python" in state:
            random.Random().setstate(python_state(state["python"]))
        if "numpy" in state:
            np.random.RandomState().set_state(numpy_state(state["numpy"]))
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise ValueError(f"a random generator state is malformed ({e})") from None


def python_state(saved: Any) -> tuple:
    """What `random.setstate()` takes, from its saved form."""
    version, internal, gauss = saved
    if not integers(internal) or internal.ndim != 1:
        raise ValueError("Python's generator state is not a vector of integers")
    if gauss is not None and not isinstance(gauss, float):
        raise ValueError("Python's cached Gaussian is not a number")
    return (version, tuple(int(v) for v in internal), gauss)


def numpy_state(saved: Any) -> tuple:
    """What `np.random.set_state()` takes, from its saved form."""
    keys, pos = saved["keys"], saved["pos"]
    if not integers(keys) or keys.shape != (_MT_KEYS,):
        raise ValueError(f"NumPy's generator keys are not {_MT_KEYS} integers")
    if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos <= _MT_KEYS:
        raise ValueError(f"NumPy's generator position is not within 0-{_MT_KEYS}")
    return (
        saved["name"],
        np.asarray(keys, dtype=np.uint32),
        pos,
        saved["has_gauss"],
        saved["cached_gaussian"],
    )


def integers(value: Any) -> bool:
    """Whether `value` is an array of integers."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "iu"
