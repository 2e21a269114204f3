"""The backend's own global generators and its determinism switches
(`keras_ft/backend/random_state.py`). Whole resumes that draw from them:
`test_rng.py`, `test_exact_resume.py`."""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest

from keras_ft.backend import random_state

TORCH = keras.backend.backend() == "torch"


def test_the_global_generator_draws_again_what_it_drew():
    """On every backend: a DataLoader(shuffle=True) draws from it on any."""
    import torch

    torch.manual_seed(3)
    torch.rand(4)
    state = random_state.generator_state()
    first = torch.rand(5)
    torch.rand(100)  # The generator moves on...
    random_state.check_generator_state(state)
    random_state.set_generator_state(state)
    assert torch.equal(torch.rand(5), first)  # ...and is set back.


@pytest.mark.parametrize(
    "damage", [lambda s: s[:10], lambda s: np.zeros(3, np.uint8), lambda s: s[::2]]
)
def test_a_malformed_state_is_refused_before_any_is_set(damage):
    import torch

    state = damage(random_state.generator_state())
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="PyTorch's generator state is malformed"):
        random_state.check_generator_state(state)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.skipif(TORCH, reason="the torch backend imports PyTorch")
def test_a_process_without_pytorch_saves_and_sets_no_pytorch_state(monkeypatch):
    """Nothing drew from PyTorch's generator where it was never imported;
    setting a saved one there would import it for nothing."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert random_state.generator_state() is None
    random_state.check_generator_state(np.zeros(3, np.uint8))  # Nothing to set.
    random_state.set_generator_state(np.zeros(3, np.uint8))
    assert "torch" not in sys.modules
    assert random_state.device_generator_states() is None


def test_without_cuda_no_device_generator_is_saved_or_set():
    """On the CPU (these machines) there is no device generator; a state
    saved on a GPU machine is set on none here."""
    assert random_state.device_generator_states() is None
    random_state.check_device_generator_states([np.zeros(16, np.uint8)])
    random_state.set_device_generator_states([np.zeros(16, np.uint8)])


def test_what_to_set_for_deterministic_accelerators(monkeypatch):
    backend = keras.backend.backend()
    if backend == "jax":
        monkeypatch.delenv("XLA_FLAGS", raising=False)
        assert "xla_gpu_deterministic_ops=true" in random_state.nondeterminism()
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
        assert random_state.nondeterminism() is None
    elif backend == "torch":
        import torch

        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        assert "use_deterministic_algorithms" in random_state.nondeterminism()
        was = torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        try:
            assert random_state.nondeterminism() is None
        finally:
            torch.use_deterministic_algorithms(was)
    else:
        said = random_state.nondeterminism()
        assert said is None or "enable_op_determinism" in said
