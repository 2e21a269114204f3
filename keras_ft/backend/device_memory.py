"""Snapshots on the accelerator, and their move to host memory.

Moving a state to host memory runs at the bus's speed, a copy on the device at
its memory's: a save copies the state on the device (`device_snapshot`) and
moves the copy to host memory beside the next steps (`move_to_host`), into a
page-locked buffer where the backend can lock one (`pin_host`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_ft.backend import host_memory
from keras_ft.once import made_once

# Snapshots on the device: what a save holds training up for on an accelerator.
#
# Moving a state to host memory runs at the bus's speed (about 1 GB/s from
# pageable memory), a copy on the device at its memory's (hundreds of GB/s).
# A save copies the state on the device, in one operation where the backend
# has one, and moves the copy to host memory beside the next steps. The
# copy is new buffers of its own: Keras' JAX trainer donates the live state
# to the next step (its buffers are then gone), and PyTorch's optimizers
# update theirs in place.


def raw_value(value: Any) -> Any:
    """The backend tensor behind a Keras variable (or `value` itself)."""
    return value.value if isinstance(value, keras.Variable) else value


def accelerator(value: Any) -> str | None:
    """The kind of accelerator holding `value` (`"gpu"`, `"tpu"`), or `None`
    for host memory."""
    value = raw_value(value)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if isinstance(value, jax.Array):
            platforms = {d.platform for d in value.devices()}
            return None if platforms == {"cpu"} else platforms.pop()
    elif backend == "torch":
        import torch

        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            kind = value.device.type
            return "gpu" if kind in ("cuda", "mps", "xpu") else kind
    elif backend == "tensorflow":
        device = getattr(value, "device", "") or ""
        if "GPU" in device.upper():
            return "gpu"
        if "TPU" in device.upper():
            return "tpu"
    return None


def device_snapshot(values: list) -> tuple[list, Callable[[], None]]:
    """Copies of `values` (backend tensors) in new device buffers, made in
    one operation where the backend has one.

    Returns:
        `(copies, ready)`: `ready()` returns once the copies are made (the
        device runs asynchronously), in any thread.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        copies = _jax_copy()(list(values))

        def ready() -> None:
            for copy in copies:
                copy.block_until_ready()

        return copies, ready
    if backend == "torch":
        import torch

        with torch.no_grad():
            copies = [
                v.detach().clone() if isinstance(v, torch.Tensor) else np.array(v)
                for v in values
            ]
        devices = {
            c.device
            for c in copies
            if isinstance(c, torch.Tensor) and c.device.type == "cuda"
        }
        events = []
        for device in devices:  # Recorded on the streams that made them.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)

        def made() -> None:
            for event in events:
                event.synchronize()

        return copies, made
    if backend == "tensorflow":
        # Copy-on-write: a tensor read from a variable keeps its values
        # when the variable is updated later (TensorFlow copies then).
        return list(_tf_copy()(list(values))), _nothing
    return [np.array(v) for v in values], _nothing


def _nothing() -> None:
    pass


def move_to_host(
    copies: list,
    destinations: list[np.ndarray],
    stopped: Callable[[], bool] = lambda: False,
    landed: Callable[[int], None] = lambda i: None,
) -> bool:
    """Moves each of `copies` (from `device_snapshot()`) into its place in
    host memory, `destinations` (arrays of the same shapes and dtypes), in
    order: `landed(i)` is called once all of `destinations[i]` has landed,
    in the order of `i`.

    PyTorch copies straight into the destinations (a DMA where they are
    page-locked, see `pin_host()`); JAX moves each array from a device in
    pieces (`_jax_move()`); TensorFlow reads each tensor.

    Each of `copies` is let go (set to `None`) once moved: its device memory
    goes back as the move goes on.

    Returns:
        `False` if `stopped()` said to stop before the move was over (it is
        asked between arrays, and between a JAX array's pieces).
    """
    backend = keras.backend.backend()
    if backend == "torch":
        return _torch_move(copies, destinations, stopped, landed)
    if backend == "jax":
        return _jax_move(copies, destinations, stopped, landed)
    for i in range(len(copies)):
        if stopped():
            return False
        _read_whole(copies, destinations, i, landed)
    return True


def _read_whole(
    copies: list,
    destinations: list[np.ndarray],
    i: int,
    landed: Callable[[int], None],
) -> None:
    """`move_to_host()` of the i-th copy at once, in this thread (a tensor
    in host memory already, or a backend without a transfer of its own)."""
    target = _bytes_of(destinations[i])
    if target.nbytes:
        target[:] = _bytes_of(np.asarray(host_memory.view(copies[i])))
    copies[i] = None
    landed(i)


def _torch_move(
    copies: list,
    destinations: list[np.ndarray],
    stopped: Callable[[], bool],
    landed: Callable[[int], None],
) -> bool:
    """`move_to_host()` on PyTorch: each copy from a GPU is queued on a
    stream of its own (one per device, from PyTorch's pool), not the
    compute stream, whose next steps' kernels would queue behind it (as
    PyTorch's DCP stages); an event after each says when it has landed,
    told as the queue goes on, and the rest at its end. The copies were
    made before this is called (`device_snapshot()`'s `ready()`), and each
    is let go only once its event has passed."""
    import torch

    pending: list[tuple[int, Any]] = []  # Queued: (index, its event).
    streams: dict[Any, Any] = {}  # Each device's stream for this move.

    def tell(wait: bool) -> None:
        while pending and (wait or pending[0][1].query()):
            i, event = pending.pop(0)
            event.synchronize()
            copies[i] = None  # Its move has landed.
            landed(i)

    done = True
    for i, (copy, destination) in enumerate(zip(copies, destinations, strict=True)):
        if stopped():
            done = False
            break
        if not isinstance(copy, torch.Tensor) or copy.device.type != "cuda":
            tell(wait=True)  # In order.
            _read_whole(copies, destinations, i, landed)
            continue
        target = torch.from_numpy(_bytes_of(destination))
        if copy.device not in streams:
            streams[copy.device] = torch.cuda.Stream(device=copy.device)
        stream = streams[copy.device]
        with torch.cuda.stream(stream):
            source = copy.detach().reshape(-1).contiguous().view(torch.uint8)
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        pending.append((i, event))
        tell(wait=False)
    tell(wait=True)  # Every move queued has landed, also when stopped.
    return done


# A piece of an array JAX moves to host memory at a time (`_jax_move()`).
_MOVE_PIECE = 64 * 1024 * 1024


def _read_in_place(array: Any) -> bool:
    """Whether a JAX array is read whole (in host memory already, or split
    across devices), not moved in pieces."""
    devices = array.devices()
    return len(devices) != 1 or next(iter(devices)).platform == "cpu"


def _jax_move(
    copies: list,
    destinations: list[np.ndarray],
    stopped: Callable[[], bool],
    landed: Callable[[int], None],
) -> bool:
    """`move_to_host()` on JAX. An array on one accelerator is moved in
    pieces of rows (its first axis) of at most `_MOVE_PIECE` bytes, the next
    piece's transfer started before the last is copied into place: JAX lands
    each transfer in host memory of its own, so whole arrays would need a
    second copy of the state there. Rows, not a flattened array: a slice of
    rows is a contiguous run of bytes, and flattening could copy the whole
    array on the device. Arrays in host memory (the CPU) are read in place."""
    import jax

    # Started, not yet in place: (piece, where it goes, the index of its
    # destination, whether it is the destination's last piece).
    pending: list[tuple[Any, np.ndarray, int, bool]] = []

    def land() -> None:
        piece, destination, index, last = pending.pop(0)
        destination[:] = _bytes_of(np.asarray(host_memory.view(piece)))
        if last:
            landed(index)

    for i, (copy, destination) in enumerate(zip(copies, destinations, strict=True)):
        if stopped():
            return False
        target = _bytes_of(destination)
        whole = not isinstance(copy, jax.Array) or copy.ndim == 0
        rows = 0 if whole else copy.shape[0]
        row_bytes = target.nbytes // rows if rows else 0
        if whole or not row_bytes or _read_in_place(copy):
            # Read at once, after the pieces before it have landed.
            while pending:
                land()
            _read_whole(copies, destinations, i, landed)
            continue
        copies[i] = None  # `copy` holds it until its last piece.
        step = max(1, _MOVE_PIECE // row_bytes)
        for start in range(0, rows, step):
            if stopped():
                return False
            piece = copy[start : start + step]
            piece.copy_to_host_async()
            end = min(start + step, rows)
            place = target[start * row_bytes : end * row_bytes]
            pending.append((piece, place, i, end == rows))
            if len(pending) > 1:
                land()
        del copy
    while pending:
        land()
    return True


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """`array`'s bytes as a flat uint8 array (a view: no copy)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def pin_host(buffer: np.ndarray, device: Any) -> Callable[[], None] | None:
    """Page-locks `buffer` (host memory a save's snapshot is moved into and
    a restore's files are read into) for DMA to and from `device` (from
    `staging_device()`): moves then run at the bus's speed rather than
    through the driver's staging copies.

    Returns:
        The function that unlocks it, or `None` where the buffer stays as it
        is (over the locked-memory limit, say).
    """
    import torch

    if torch.device(device).type != "cuda":
        return None
    cudart = torch.cuda.cudart()
    address, size = buffer.ctypes.data, buffer.nbytes
    # cudaHostRegisterPortable (1): page-locked for every device's context,
    # as PyTorch's own pin_memory() registers it.
    if not size:
        return None
    if int(cudart.cudaHostRegister(address, size, 1)) != 0:
        # The runtime keeps the error for the thread's next check, where
        # PyTorch would raise it from an unrelated call.
        _clear_cuda_error()
        return None

    def unpin() -> None:
        cudart.cudaHostUnregister(address)

    return unpin


def _clear_cuda_error() -> None:
    """Resets the CUDA runtime's last error in this thread, through the
    runtime library PyTorch loaded (its bindings have no call for it)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError, IndexError):
        pass


def staging_device(value: Any) -> Any:
    """The accelerator holding `value`, where host memory can be page-locked
    for it (`pin_host()`) and values moved there from it (`to_device()`);
    else `None`: host memory (no accelerator), or a backend with no public
    way to lock memory it did not allocate (JAX and TensorFlow stage their
    transfers through page-locked buffers of their own)."""
    value = raw_value(value)
    if keras.backend.backend() != "torch":
        return None
    import torch

    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
        return value.device
    return None


def to_device(array: np.ndarray, device: Any) -> Any:
    """`array` (in page-locked memory) on `device` (from `staging_device()`),
    moved without waiting: `transfers_done()` waits for every such move."""
    import torch

    if array.dtype.name == "bfloat16":  # NumPy's bfloat16 is not PyTorch's.
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor.to(device, non_blocking=True)


def transfers_done(device: Any) -> None:
    """Returns once every `to_device()` move to `device` has landed."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _jax_copy() -> Callable[[list], list]:
    def make() -> Any:
        import jax
        import jax.numpy as jnp

        # One executable for the whole state (not a dispatch per variable);
        # its outputs never alias its inputs (nothing is donated).
        return jax.jit(lambda xs: [jnp.copy(x) for x in xs])

    return made_once("jax copy", make)


def shard_shape(value: Any) -> tuple[int, ...]:
    """The shape of the piece of `value` each device holding it holds: its
    shape, unless it is split across devices (JAX)."""
    value = raw_value(value)
    shape = tuple(value.shape)
    sharding = getattr(value, "sharding", None)
    if keras.backend.backend() == "jax" and hasattr(sharding, "shard_shape"):
        return tuple(sharding.shard_shape(shape))
    return shape


def _tf_copy() -> Callable[[list], list]:
    def make() -> Any:
        import tensorflow as tf

        return tf.function(
            lambda xs: [tf.identity(x) for x in xs], reduce_retracing=True
        )

    return made_once("tensorflow copy", make)


def device_free_bytes(value: Any) -> int | None:
    """Bytes free on the accelerator holding `value`, as far as its backend
    says (`None`: not known, or host memory)."""
    value = raw_value(value)
    backend = keras.backend.backend()
    try:
        if backend == "jax":
            (device, *_) = value.devices()
            stats = device.memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        elif backend == "torch":
            import torch

            if value.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(value.device)
                # What its caching allocator holds unused is free to it too.
                cached = torch.cuda.memory_reserved(
                    value.device
                ) - torch.cuda.memory_allocated(value.device)
                return int(free + cached)
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return None
    return None  # TensorFlow's allocator says what it holds, not its room.
