"""Global random state: captured, then put back, continues the same stream."""

from __future__ import annotations

import random

import keras
import numpy as np
import pytest
from conftest import CrashAt

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


def test_model_side_is_pytorchs_generator_only_on_its_own_backend():
    on_torch = keras.backend.backend() == "torch"
    assert ("torch" in rng.model_side()) == on_torch
    assert "keras" in rng.model_side()


def test_a_dataloader_drawing_from_pytorch_resumes_mid_epoch_exact(tmp_path):
    """Its shuffle and its dataset's noise draw from PyTorch's generator:
    the data side's on JAX and TensorFlow (there in a thread that loads
    ahead), so a resumed epoch replays the draws of its trained batches and
    does not set the generator as at the save after them."""
    torch = pytest.importorskip("torch")
    import keras_ft

    rows = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i] + 0.1 * torch.randn(4).numpy(), rows[i, :1]

    def fit(backup_dir, *crash):
        keras.utils.set_random_seed(3)
        torch.manual_seed(3)  # Seeded by Keras on its own backend only.
        loader = torch.utils.data.DataLoader(Noisy(), batch_size=8, shuffle=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        backup = keras_ft.BackupAndRestore(str(backup_dir), save_freq=2, verbose=0)
        model.fit(loader, epochs=3, verbose=0, callbacks=[backup, *crash])
        return model

    reference = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "resumed", CrashAt())
    resumed = fit(tmp_path / "resumed")
    for a, b in zip(reference.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
