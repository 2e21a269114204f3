"""What building a model would allocate, learned without allocating it
(`keras_ft/compat/building.py`). The check that uses it on a forged backup:
`test_checks.py`, `test_hostile_backups.py`."""

from __future__ import annotations

import keras
import pytest

from keras_ft import compat
from keras_ft.compat import building
from keras_ft.errors import CompatibilityWarning


def pending() -> int:
    """How many variables wait in Keras' global list to be initialized."""
    from keras.src.backend.common import global_state

    return len(global_state.get_global_attribute(building._PENDING, []) or [])


def model() -> keras.Model:
    return keras.Sequential(
        [keras.layers.Dense(5), keras.layers.Dense(2, dtype="bfloat16")]
    )


def test_the_planned_variables_are_the_built_ones():
    unbuilt = model()
    before = pending()
    planned = building.planned_variables(unbuilt, {"input_shape": [None, 3]})
    assert planned == [((3, 5), "float32"), ((5,), "float32"),
                       ((5, 2), "bfloat16"), ((2,), "bfloat16")]  # fmt: skip
    assert not unbuilt.built  # The model itself is not built...
    assert pending() == before  # ...and the copy left nothing to initialize.
    unbuilt.build((None, 3))
    assert [(tuple(v.shape), str(v.dtype)) for v in unbuilt.weights] == planned


def test_a_huge_build_allocates_nothing():
    planned = building.planned_variables(model(), {"input_shape": [None, 10**12]})
    assert planned[0] == ((10**12, 5), "float32")


def test_a_model_without_a_config_cannot_be_planned():
    class NoConfig(keras.Model):
        def __init__(self, units):  # from_config(get_config()) cannot make it.
            super().__init__()
            self.dense = keras.layers.Dense(units)

        def call(self, x):
            return self.dense(x)

    assert building.planned_variables(NoConfig(3), {"input_shape": [None, 2]}) is None


def test_without_the_internal_nothing_is_planned():
    warned = pytest.warns(CompatibilityWarning, match="build_config is not")
    with warned, compat.disabled("dry_build"):
        assert building.planned_variables(model(), {"input_shape": [None, 3]}) is None
