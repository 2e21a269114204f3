"""The global random generators beyond Python's and NumPy's (PyTorch's CPU
generator wherever PyTorch is imported, its device generators on the torch
backend), and whether the backend's ops are deterministic.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np


def generator_state() -> np.ndarray | None:
    """The state of PyTorch's global CPU generator, where PyTorch is imported.

    An unseeded Dropout on the torch backend draws from it, and so does a
    `RandomSampler` shuffling arrays, or a `DataLoader(shuffle=True)` on any
    backend. A process that never imported PyTorch draws nothing from it.
    """
    if "torch" not in sys.modules:
        return None
    import torch

    return torch.get_rng_state().numpy().copy()


def steps_draw_from_torch() -> bool:
    """Whether training steps draw from PyTorch's generators: on its own
    backend (an unseeded Dropout). Elsewhere only a `DataLoader` does, on
    the data side."""
    return keras.backend.backend() == "torch"


def set_generator_state(state: np.ndarray) -> None:
    """Sets what `generator_state()` returned, where PyTorch is imported (a
    process that has not imported it yet has drawn nothing from it; importing
    it here would cost seconds for nothing)."""
    if "torch" in sys.modules:
        import torch

        torch.set_rng_state(torch.from_numpy(np.asarray(state, np.uint8)))


def device_generator_states() -> list[np.ndarray] | None:
    """The states of PyTorch's generators on its CUDA devices, one per
    device, where CUDA is in use (an unseeded Dropout on a GPU draws from
    its device's generator, not from `generator_state()`'s)."""
    if keras.backend.backend() != "torch" or "torch" not in sys.modules:
        return None
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return [state.numpy().copy() for state in torch.cuda.get_rng_state_all()]


def set_device_generator_states(states: list[np.ndarray]) -> None:
    """Sets what `device_generator_states()` returned, on the devices this
    process has (none where CUDA is not available: a resume on the CPU
    draws from other generators anyway)."""
    if keras.backend.backend() != "torch":
        return
    import torch

    if not torch.cuda.is_available():
        return
    for device, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(torch.from_numpy(np.asarray(state, np.uint8)), device)


def check_device_generator_states(states: list[np.ndarray]) -> None:
    """Raises `ValueError` unless `set_device_generator_states(states)`
    would take them: each is set first on a generator of its own."""
    if keras.backend.backend() != "torch":
        return
    import torch

    if not torch.cuda.is_available():
        return
    for device, state in enumerate(states[: torch.cuda.device_count()]):
        try:
            torch.Generator(device=f"cuda:{device}").set_state(
                torch.from_numpy(np.asarray(state, np.uint8))
            )
        except RuntimeError as e:
            raise ValueError(
                f"PyTorch's generator state for cuda:{device} is malformed ({e})"
            ) from None


def check_generator_state(state: np.ndarray) -> None:
    """Raises `ValueError` unless `set_generator_state(state)` would take
    it: set first on a generator of its own."""
    if "torch" in sys.modules:
        import torch

        try:
            torch.Generator().set_state(torch.from_numpy(np.asarray(state, np.uint8)))
        except RuntimeError as e:
            raise ValueError(f"PyTorch's generator state is malformed ({e})") from None


def nondeterminism() -> str | None:
    """What to set for bitwise-reproducible training on this backend's
    accelerators, if it is not set; `None` if it is."""
    backend = keras.backend.backend()
    if backend == "jax":
        if "--xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", ""):
            return None
        return (
            "XLA_FLAGS=--xla_gpu_deterministic_ops=true in the environment "
            "before JAX starts"
        )
    if backend == "torch":
        import torch

        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if torch.are_deterministic_algorithms_enabled() and workspace in (
            ":4096:8",
            ":16:8",
        ):
            return None
        return (
            "torch.use_deterministic_algorithms(True), with "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment"
        )
    if backend == "tensorflow":
        from keras_ft.compat import tf_op_determinism

        if tf_op_determinism():
            return None
        return "tf.config.experimental.enable_op_determinism()"
    return None
