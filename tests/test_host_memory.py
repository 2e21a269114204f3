"""Host memory with as few copies as can be (`keras_ft/backend/host_memory.py`):
a variable viewed in place, and an array handed to `assign()` in the form its
backend copies least. Round trips through whole saves: `test_weights_layout.py`."""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest

from keras_ft.backend import host_memory


def variable(values: np.ndarray) -> keras.Variable:
    return keras.Variable(values, dtype=str(values.dtype))


def test_a_variable_is_viewed_in_place():
    v = variable(np.arange(12, dtype="float32").reshape(3, 4))
    first, second = host_memory.view(v), host_memory.view(v)
    np.testing.assert_array_equal(first, np.arange(12).reshape(3, 4))
    assert first.dtype == np.float32 and first.shape == (3, 4)
    # Both are the variable's own buffer, not copies of it.
    assert np.shares_memory(first, second)


def test_an_optimizers_variables_are_viewed_in_place_and_keep_their_values():
    # An optimizer builds its variables in a step (on TensorFlow, inside a
    # tf.function: another class of variable than a layer's).
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(0.1), loss="mse")
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    for v in model.weights + model.optimizer.variables:
        first, second = host_memory.view(v), host_memory.view(v)
        np.testing.assert_array_equal(first, keras.ops.convert_to_numpy(v))
        assert np.shares_memory(first, second), v.path
    if keras.backend.backend() == "tensorflow":
        # A view read before a step keeps its values (TensorFlow copies the
        # variable's buffer before updating it while a read holds it).
        kernel = model.weights[0]
        held = host_memory.view(kernel)
        before = held.copy()
        model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
        np.testing.assert_array_equal(held, before)
        assert not np.array_equal(host_memory.view(kernel), before)


def test_an_array_is_its_own_view_and_a_tensor_is_viewed():
    array = np.ones(5, "float32")
    assert host_memory.view(array) is array
    tensor = keras.ops.convert_to_tensor(np.arange(5, dtype="int32"))
    np.testing.assert_array_equal(host_memory.view(tensor), np.arange(5))


def test_what_is_not_a_backend_value_is_converted():
    np.testing.assert_array_equal(host_memory.view([1.0, 2.0]), [1.0, 2.0])


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(16, dtype="float32"), id="aligned"),
        # One float past a 64-byte boundary: TensorFlow's kernels refuse it
        # shared, so it is handed over as it is (and copied by Keras).
        pytest.param(lambda: np.arange(17, dtype="float32")[1:], id="unaligned"),
        pytest.param(lambda: np.arange(32, dtype="float32")[::2], id="strided"),
    ],
)
def test_an_assigned_array_sets_the_variable(make):
    array = make()
    v = variable(np.zeros(16, "float32"))
    v.assign(host_memory.for_assign(array))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), array)
    if keras.backend.backend() != "jax":
        # TensorFlow and PyTorch keep a copy of their own: the array may be
        # reused (JAX aliases it, and training replaces the value).
        array[:] = -1
        assert keras.ops.convert_to_numpy(v).min() >= 0


def test_bfloat16_is_assigned_without_dlpack():
    """DLPack refuses bfloat16: TensorFlow takes the array as it is."""
    array = np.arange(8).astype(ml_dtypes.bfloat16)
    v = variable(np.zeros(8, ml_dtypes.bfloat16))
    v.assign(host_memory.for_assign(array))
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(v).astype("float32"), np.arange(8)
    )
