"""Global random state: captured, then put back, continues the same stream."""

from __future__ import annotations

import random

import keras
import numpy as np
import pytest

from keras_ft.state import arrays, rng


def draws():
    values = [random.random(), float(np.random.normal()), np.random.permutation(5)]
    if keras.backend.backend() == "torch":
        import torch

        values.append(torch.randperm(5).tolist())
        if torch.cuda.is_available():  # An unseeded Dropout's, on a GPU.
            values.append(torch.rand(3, device="cuda").tolist())
    values.append(keras.ops.convert_to_numpy(keras.random.normal((2,))).tolist())
    return values


def test_apply_continues_the_captured_stream():
    keras.utils.set_random_seed(1)
    draws()  # Creates Keras' global seed generator, as a real run would.
    saved = rng.capture()
    expected = draws()
    draws()
    rng.apply(saved)
    assert repr(draws()) == repr(expected)


def test_captured_state_survives_json_and_hdf5(tmp_path):
    keras.utils.set_random_seed(2)
    draws()
    tree, saved_arrays = arrays.split(rng.capture())
    (tmp_path / "a.h5").write_bytes(arrays.to_bytes(saved_arrays))
    expected = draws()
    restored = arrays.join(tree, arrays.read(str(tmp_path / "a.h5")))
    rng.apply(restored)
    assert repr(draws()) == repr(expected)


def test_capture_does_not_create_the_keras_global_generator():
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("global_seed_generator", None)
    state = rng.capture()
    assert "keras" not in state
    assert global_state.get_global_attribute("global_seed_generator") is None


def test_apply_only_sets_the_named_generators():
    keras.utils.set_random_seed(3)
    draws()
    saved = rng.capture()
    expected_numpy = np.random.permutation(10)
    np.random.permutation(10)
    after_numpy = np.random.get_state()[1].copy()
    rng.apply(saved, only=("python",))
    np.testing.assert_array_equal(np.random.get_state()[1], after_numpy)
    rng.apply(saved, only=("numpy",))
    np.testing.assert_array_equal(np.random.permutation(10), expected_numpy)


@pytest.mark.parametrize(
    "cuda", [[np.zeros(16, np.int64)], np.zeros(16, np.uint8), ["state"]]
)
def test_a_malformed_cuda_generator_state_is_refused(cuda):
    state = rng.capture()
    state["torch_cuda"] = cuda
    with pytest.raises(ValueError, match="CUDA generator states are not bytes"):
        rng.check(state)
