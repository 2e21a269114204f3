"""Where a save's copy of the training state is made: on its device, or in
host memory.

Training must not change a value while it is being saved, so a save holds
training up for a copy of the state. On the CPU that copy goes straight into
the host buffer the writer writes from. On an accelerator, a copy into host
memory crosses the bus (about 1 GB/s from pageable memory: seconds for a
2.5 GB state), where a copy into new device buffers takes milliseconds: that
copy is what training waits for there, and the move of it into host memory
runs beside the next steps (`backend.device_snapshot()`,
`WeightsLayout.capture(on_device=True)`). It needs room for one more copy of
the state on the device: where the device says it has none, saves copy to
host memory, and say so once.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_ft import events
from keras_ft.backend import device_memory, random_state
from keras_ft.state.checks import nbytes

SNAPSHOT_MODES = ("auto", "device", "host")
# The share of the device's free memory a snapshot may take: the rest is
# left to what training allocates between saves.
_ROOM = 0.9
# How each backend's allocator says it has no room (PyTorch's
# OutOfMemoryError, XLA's RESOURCE_EXHAUSTED, TensorFlow's
# ResourceExhaustedError).
_OUT_OF_MEMORY = ("out of memory", "OutOfMemory", "RESOURCE_EXHAUSTED",
                  "ResourceExhausted")  # fmt: skip


def validate_snapshot(value: object) -> str:
    """Returns `value` if it is a snapshot mode, or raises a `ValueError`."""
    if not isinstance(value, str) or value not in SNAPSHOT_MODES:
        raise ValueError(
            "Invalid value for argument `snapshot`. Expected one of "
            f"{', '.join(repr(m) for m in SNAPSHOT_MODES)}. Received: "
            f"snapshot={value!r}"
        )
    return value


class SnapshotPlace:
    """Decides, at the first save, where this training's saves copy the state.

    Args:
        mode: `"auto"`: on the device where the state is on an accelerator
            with room for a copy, else in host memory (on the CPU the two are
            one copy); `"device"`: on the device wherever it has room (on the
            CPU too: a second copy, for tests); `"host"`: in host memory.
    """

    def __init__(self, mode: str):
        self.mode = validate_snapshot(mode)
        self._on_device: bool | None = None

    def on_device(self, variables: Callable[[], list]) -> bool:
        """Whether to snapshot the saved variables (`variables()` gives
        them, asked once) on their device."""
        if self._on_device is None:
            self._on_device = self._decide(variables())
        return self._on_device

    def out_of_memory(self, error: BaseException) -> bool:
        """Whether `error` (raised by a snapshot on the device) is the device
        running out of memory; if so, saves copy to host memory from now on,
        and this is said once."""
        text = f"{type(error).__name__}: {error}"
        if not any(sign in text for sign in _OUT_OF_MEMORY):
            return False
        self._on_device = False
        events.warn(
            "fallback",
            "keras-ft: the device ran out of memory for a snapshot of the "
            f"training state ({text.splitlines()[0][:200]}); saves copy it to "
            "host memory from now on, and training waits for that copy. Pass "
            "snapshot='host' to choose this from the start.",
            stacklevel=3,
        )
        return True

    def _decide(self, variables: list) -> bool:
        kind = device_memory.accelerator(variables[0]) if variables else None
        if kind is not None:
            _tell_nondeterminism(kind)
        if self.mode == "host" or not variables:
            return False
        if self.mode == "auto" and kind is None:
            return False  # On the CPU, the snapshot is the host copy itself.
        # On each device, its own pieces of the variables split across devices.
        needed = sum(
            nbytes(
                device_memory.shard_shape(v), keras.backend.standardize_dtype(v.dtype)
            )
            for v in variables
        )
        free = device_memory.device_free_bytes(variables[0])
        if free is not None and needed > free * _ROOM:
            events.warn(
                "fallback",
                f"keras-ft: no room on the {kind.upper() if kind else 'device'} "
                "for a snapshot of "
                f"the training state ({_size(needed)} needed, {_size(free)} "
                "free): saves copy it to host memory "
                "instead, and training waits for that copy. Pass "
                "snapshot='host' to choose this and silence this notice.",
                stacklevel=4,
            )
            return False
        return True


def _size(nbytes: int) -> str:
    for unit in ("bytes", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _tell_nondeterminism(kind: str) -> None:
    """Says once, where kernels on this accelerator are not deterministic,
    that no run there is bitwise reproducible, and what makes it so."""
    backend = keras.backend.backend()
    if not events.first_time("nondeterminism", backend):
        return
    advice = random_state.nondeterminism()
    if advice is None:
        return
    events.warn(
        "save",
        f"keras-ft: training on a {kind.upper()} with {backend}'s default, "
        "nondeterministic kernels: no run here is bitwise reproducible, resumed "
        "or not (two uninterrupted runs differ too). A resumed run continues "
        "the saved state exactly; for runs that are reproducible bit for bit, "
        f"set {advice}.",
        stacklevel=4,
    )
