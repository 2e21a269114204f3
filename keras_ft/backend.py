"""What differs between the TensorFlow, JAX and PyTorch backends.

How each backend's `fit()` loop calls `train_function` (`skipped_step`),
its global random generator beyond Python's and NumPy's (`generator_state`),
and how it hands out and takes in host memory, with as few copies as can be:
the rest of keras-ft is backend-agnostic.

Host memory. On the CPU, TensorFlow's tensors, JAX's arrays and PyTorch's tensors
can all be viewed as NumPy arrays in place (`view`); `keras.ops.
convert_to_numpy()` copies instead (and a TensorFlow variable's `numpy()`
copies once more). A view is only valid until the backend updates the
variable, so callers copy it or write it out before the next training step.
The other way (`for_assign`), an array is handed to a variable's `assign()`
in the form that backend copies least: Keras' own conversion copies it twice
on TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import keras
import ml_dtypes
import numpy as np


def skipped_step(
    args: tuple, logs: dict, count: int, pull: bool = True
) -> tuple[Any, list, Any]:
    """What a no-op `train_function(*args)` must pull and return.

    - TensorFlow: `train_function(iterator)`, the function pulls the batches;
    - JAX: `train_function(state, iterator)` returns `(logs, state)`;
    - PyTorch: `train_function(data)`, the loop has already pulled the batch.

    Args:
        pull: Whether to pull `count` batches (to draw them through the
            pipeline); not when the input skips them at its source.

    Returns:
        `(result, batches pulled, the iterator pulled from or None)`.
    """
    iterator = step_iterator(args)
    batches = _pull(iterator, count) if pull and iterator is not None else []
    if keras.backend.backend() == "jax":
        return (logs, args[0]), batches, iterator
    return logs, batches, iterator


def step_iterator(args: tuple) -> Any:
    """The data iterator a `train_function(*args)` pulls from, or `None`
    (PyTorch: the loop pulled the batch)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return args[0]
    if backend == "jax":
        return args[1]
    return None


def loop_pulls_batches() -> bool:
    """Whether `fit()` pulls every step's batches itself, before calling
    `train_function` (PyTorch): a step skipped at the input's source must
    then still be handed something."""
    return keras.backend.backend() == "torch"


def _pull(iterator: Any, count: int) -> list:
    batches = []
    for _ in range(count):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches


def generator_state() -> np.ndarray | None:
    """The state of the backend's own global generator (PyTorch's), if any.

    An unseeded Dropout on the torch backend draws from it, and so does a
    `RandomSampler` shuffling arrays.
    """
    if keras.backend.backend() != "torch" or "torch" not in sys.modules:
        return None
    import torch

    return torch.get_rng_state().numpy().copy()


def set_generator_state(state: np.ndarray) -> None:
    """Sets what `generator_state()` returned."""
    if keras.backend.backend() == "torch":
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
    if keras.backend.backend() == "torch":
        import torch

        try:
            torch.Generator().set_state(torch.from_numpy(np.asarray(state, np.uint8)))
        except RuntimeError as e:
            raise ValueError(f"PyTorch's generator state is malformed ({e})") from None


# The alignment TensorFlow's CPU kernels require of a tensor's data.
_TF_ALIGNMENT = 64


def view(value: Any) -> np.ndarray:
    """`value` (a Keras variable, backend tensor or array) as a NumPy array.

    Shares memory with `value` when it lives in host memory; otherwise (a GPU
    tensor, an unusual type) returns a copy.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, keras.Variable):
        value = value.value
    try:
        array = _view_of(value)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        array = None
    if array is None:
        array = keras.ops.convert_to_numpy(value)
    return np.asarray(array)


def _view_of(value: Any) -> np.ndarray | None:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if isinstance(value, tf.Variable):
            # A read shares the variable's buffer; `numpy()` would copy it.
            value = value.read_value()
        if isinstance(value, tf.Tensor):
            return np.asarray(value)
    elif backend == "jax":
        import jax

        if isinstance(value, jax.Array):
            return np.asarray(value)
    elif backend == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
    return None


def for_assign(array: np.ndarray) -> Any:
    """`array` as the value to pass to a Keras variable's `assign()`.

    On TensorFlow, a tensor with its own copy of the values, made in one
    copy (Keras converts an array by copying it, then copying the copy again
    if that is unaligned). On JAX, a JAX array sharing `array`'s memory
    (`assign()` keeps it as is; Keras' own conversion would copy). Elsewhere
    `array` itself: PyTorch copies it into the variable.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        # No copy: fresh pages cost more to fault in here than the disk
        # takes to read them. The file stays share-locked (not recycled)
        # while arrays alias it; training replaces every one of them.
        return jax.device_put(array, may_alias=True)
    if backend != "tensorflow":
        return array
    import tensorflow as tf

    # TensorFlow aborts the process on an unaligned DLPack tensor.
    if array.ctypes.data % _TF_ALIGNMENT or not array.flags.c_contiguous:
        return array
    try:
        shared = tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    except (TypeError, ValueError, RuntimeError, BufferError):
        return array  # E.g. bfloat16, which DLPack refuses.
    return tf.raw_ops.DeepCopy(x=shared)


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
    before: Callable[[int], None] = lambda i: None,
    landed: Callable[[int], None] = lambda i: None,
) -> bool:
    """Moves each of `copies` (from `device_snapshot()`) into its place in
    host memory, `destinations` (arrays of the same shapes and dtypes), in
    order: `before(i)` is called before anything lands in `destinations[i]`
    (it may wait for that memory to be free), and `landed(i)` once all of
    it has, in the order of `i`.

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
        return _torch_move(copies, destinations, stopped, before, landed)
    if backend == "jax":
        return _jax_move(copies, destinations, stopped, before, landed)
    for i in range(len(copies)):
        if stopped():
            return False
        _read_whole(copies, destinations, i, before, landed)
    return True


def _read_whole(
    copies: list,
    destinations: list[np.ndarray],
    i: int,
    before: Callable[[int], None],
    landed: Callable[[int], None],
) -> None:
    """`move_to_host()` of the i-th copy at once, in this thread (a tensor
    in host memory already, or a backend without a transfer of its own)."""
    before(i)
    target = _bytes_of(destinations[i])
    if target.nbytes:
        target[:] = _bytes_of(np.asarray(view(copies[i])))
    copies[i] = None
    landed(i)


def _torch_move(
    copies: list,
    destinations: list[np.ndarray],
    stopped: Callable[[], bool],
    before: Callable[[int], None],
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
            _read_whole(copies, destinations, i, before, landed)
            continue
        before(i)
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
    before: Callable[[int], None],
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
    waited = -1  # The last destination `before()` was called for.

    def land() -> None:
        nonlocal waited
        piece, destination, index, last = pending.pop(0)
        if waited < index:
            before(index)
            waited = index
        destination[:] = _bytes_of(np.asarray(view(piece)))
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
            _read_whole(copies, destinations, i, before, landed)
            waited = i
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


_jitted: dict[str, Any] = {}  # One compiled copy per backend, reused.


def _jax_copy() -> Callable[[list], list]:
    if "jax" not in _jitted:
        import jax
        import jax.numpy as jnp

        # One executable for the whole state (not a dispatch per variable);
        # its outputs never alias its inputs (nothing is donated).
        _jitted["jax"] = jax.jit(lambda xs: [jnp.copy(x) for x in xs])
    return _jitted["jax"]


def non_finite_pieces(copies: list) -> set[int]:
    """The indices of `copies` (from `device_snapshot()`) of which a piece on
    this process's devices holds a NaN or an infinity; waits for the check
    (and for the steps queued before it).

    Each device checks what it holds, with one operation (no collective: a
    process that checks another way, or not at all, holds no other up). A
    piece held by another process only is that process's to check.
    """
    import jax

    by_device: dict[Any, list[tuple[int, Any]]] = {}
    for i, copy in enumerate(copies):
        if isinstance(copy, jax.Array) and _floating(copy):
            for shard in copy.addressable_shards:
                by_device.setdefault(shard.device, []).append((i, shard.data))
    flags = [
        (held, _jax_finite_each()([data for _, data in held]))
        for held in by_device.values()
    ]  # Launched on every device before any is read.
    return {
        i
        for held, finite in flags
        for (i, _), ok in zip(held, np.asarray(finite), strict=True)
        if not ok
    }


def _jax_finite_each() -> Callable[[list], Any]:
    if "jax_finite_each" not in _jitted:
        import jax
        import jax.numpy as jnp

        _jitted["jax_finite_each"] = jax.jit(
            lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs])
        )
    return _jitted["jax_finite_each"]


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
    if "tensorflow" not in _jitted:
        import tensorflow as tf

        _jitted["tensorflow"] = tf.function(
            lambda xs: [tf.identity(x) for x in xs], reduce_retracing=True
        )
    return _jitted["tensorflow"]


def device_all_finite(values: list) -> bool:
    """Whether `values` (Keras variables or backend tensors) hold no NaN or
    infinity, checked where they live: one reduction on the device, and one
    boolean read back, rather than every value copied to host memory (on a
    GPU that copy, at every batch, would cost more than the step)."""
    flag = finite_flag(values)
    if flag is None or bool(flag):
        return True
    if keras.backend.backend() == "torch":
        import torch

        # The flag sums each value: only an overflowing sum of finite values
        # needs the exact check.
        with torch.no_grad():
            tensors = [raw_value(v) for v in values if _floating(v)]
            return all(bool(torch.isfinite(t).all()) for t in tensors)
    return False


def finite_flag(values: list) -> Any:
    """One boolean on the device, launched and not read: whether `values`
    hold no NaN or infinity (`None` where none is floating). Reading it
    waits for the reduction, and for the steps queued before it. On
    PyTorch it is the sums' (in float32 for narrower types): `False` also
    where a sum of finite values overflowed (`device_all_finite` is
    exact)."""
    tensors = [raw_value(v) for v in values if _floating(v)]
    if not tensors:
        return None
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_all_finite()(tensors)
    if backend == "torch":
        import torch

        with torch.no_grad():
            sums = torch.stack(
                [torch.sum(t, dtype=torch.float32).reshape(()) for t in tensors]
            )
            return torch.isfinite(sums).all()
    if backend == "tensorflow":
        return _tf_all_finite()(tensors)
    return all(all_finite(np.asarray(t).reshape(-1)) for t in tensors)


def _floating(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    # A Keras variable's dtype is its name, a NumPy or JAX dtype has one;
    # the rest (PyTorch's, TensorFlow's) are named by Keras.
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if not isinstance(name, str) or isinstance(dtype, type):
        name = keras.backend.standardize_dtype(dtype)
    return name.startswith(("float", "bfloat"))


def _jax_all_finite() -> Callable[[list], Any]:
    if "jax_finite" not in _jitted:
        import jax
        import jax.numpy as jnp

        # One executable for every value, one boolean out.
        _jitted["jax_finite"] = jax.jit(
            lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs]))
        )
    return _jitted["jax_finite"]


def _tf_all_finite() -> Callable[[list], Any]:
    if "tensorflow_finite" not in _jitted:
        import tensorflow as tf

        _jitted["tensorflow_finite"] = tf.function(
            lambda xs: tf.reduce_all(
                tf.stack([tf.reduce_all(tf.math.is_finite(x)) for x in xs])
            ),
            reduce_retracing=True,
        )
    return _jitted["tensorflow_finite"]


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


# Variables split across processes (JAX, `keras.distribution.ModelParallel`).


def spans_processes(value: Any) -> bool:
    """Whether `value` is split across processes: none can read it whole.

    Only a JAX array sharded over devices of several processes is. One that
    is replicated on every device (data parallelism) is read from the local
    copy, as on one process.
    """
    if keras.backend.backend() != "jax":
        return False
    if isinstance(value, keras.Variable):
        value = value.value
    import jax

    return (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.is_fully_replicated
    )


Bounds = tuple[tuple[int, ...], tuple[int, ...]]


def own_pieces(value: Any) -> list[tuple[Bounds, np.ndarray]]:
    """The pieces of `value` this process writes, as `((start, stop), view)`.

    A JAX array's pieces are the shards on this process's devices of which
    it holds the first replica (replica id 0), so that of all processes
    exactly one writes each piece. The views are valid until the variable
    changes. Other backends' values are one piece, the whole value.
    """
    return [(bounds, data) for bounds, data, first in held_pieces(value) if first]


def held_pieces(value: Any) -> list[tuple[Bounds, np.ndarray, bool]]:
    """Every distinct piece of `value` on this process's devices, as
    `((start, stop), view, first)`: `first` if this process holds its first
    replica (the pieces of `own_pieces()`). What this process needs to
    rebuild its slices by itself (a local tier)."""
    return [
        (bounds, data if isinstance(data, np.ndarray) else np.asarray(data), first)
        for bounds, data, first in held_shards(value)
    ]


def held_shards(value: Any) -> list[tuple[Bounds, Any, bool]]:
    """`held_pieces()` without reading them: a JAX array's pieces are its
    shards' arrays, on their devices; other backends' value is one piece, a
    NumPy view of it."""
    if isinstance(value, keras.Variable):
        value = value.value
    shape = tuple(value.shape)
    if keras.backend.backend() == "jax":
        import jax

        if isinstance(value, jax.Array):
            pieces: dict[Bounds, tuple[Any, bool]] = {}
            for shard in value.addressable_shards:
                bounds = _bounds(shard.index, shape)
                held = pieces.get(bounds)
                if held is None or (shard.replica_id == 0 and not held[1]):
                    data = held[0] if held is not None else shard.data
                    pieces[bounds] = (data, shard.replica_id == 0)
            return [(bounds, data, first) for bounds, (data, first) in pieces.items()]
    return [(((0,) * len(shape), shape), view(value), True)]


def build_like(
    value: Any, shape: tuple[int, ...], read: Callable[[Bounds], np.ndarray]
) -> Any:
    """A value for `value`'s variable, laid out as `value` is.

    On JAX, each of this process's devices gets the slice its sharding
    assigns it, `read((start, stop))`; nothing else is read. Elsewhere the
    whole value is read.
    """
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "jax":
        import jax

        if isinstance(value, jax.Array):
            return jax.make_array_from_callback(
                shape, value.sharding, lambda index: read(_bounds(index, shape))
            )
    return for_assign(read(((0,) * len(shape), tuple(shape))))


def bounds_needed(value: Any, shape: tuple[int, ...]) -> list[Bounds]:
    """The slices of `value`'s variable that `build_like()` reads here, each
    once, in the order it reads them."""
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "jax":
        import jax

        if isinstance(value, jax.Array):
            indices = value.sharding.addressable_devices_indices_map(shape)
            return list(dict.fromkeys(_bounds(i, shape) for i in indices.values()))
    return [((0,) * len(shape), tuple(shape))]


def sharding_text(value: Any) -> str:
    """How `value` is laid out, for people reading a checkpoint's index."""
    if isinstance(value, keras.Variable):
        value = value.value
    sharding = getattr(value, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return "whole"
    axes = ", ".join(f"{n}={s}" for n, s in dict(mesh.shape).items())
    return f"{spec} over mesh({axes})"


def collectives_scope(model: Any) -> contextlib.AbstractContextManager:
    """Where the processes' agreements about `model` run: the scope of the
    `tf.distribute.MultiWorkerMirroredStrategy` it was built under on
    TensorFlow (`fit()` may be called outside it), nothing to enter
    elsewhere."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        strategy = getattr(model, "distribute_strategy", None)
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return strategy.scope()
    return contextlib.nullcontext()


def coordinator_in_process_zero() -> bool:
    """Whether the cluster's coordination service runs inside process 0, so
    that the other processes abort once it is gone (JAX's); TensorFlow's
    workers coordinate among themselves."""
    return keras.backend.backend() == "jax"


def all_processes_agree(flag: bool) -> bool:
    """Whether `flag` is true in every process of a cluster (JAX's, a
    `MultiWorkerMirroredStrategy` in scope, a `torch.distributed` group).

    A collective: every process must call it, in the same order. One
    process returns `flag`.
    """
    return bool(np.all(_gather(int(bool(flag)))))


def same_in_all_processes(value: int) -> bool:
    """Whether every process of a cluster passes the same `value`.

    A collective, as `all_processes_agree()`.
    """
    values = _gather(int(value))
    return bool(np.all(values == values.flat[0]))


def least_in_all_processes(value: int) -> int:
    """The least `value` any process of a cluster passes.

    A collective, as `all_processes_agree()`.
    """
    return int(_gather(int(value)).min())


def first_process_value(value: int) -> int:
    """The `value` process 0 of a cluster passes, in every process.

    A collective, as `all_processes_agree()`.
    """
    return int(_gather(int(value)).flat[0])


def gathers_across_processes() -> bool:
    """Whether this process can reach the others' values: a JAX cluster, a
    `MultiWorkerMirroredStrategy` in scope (TensorFlow), or an initialised
    `torch.distributed` group (PyTorch); one process reaches its own."""
    backend = keras.backend.backend()
    if backend == "jax":
        return True  # jax.process_count() is 1 outside a cluster.
    if backend == "tensorflow":
        return _tf_cluster_strategy() is not None
    return _torch_group_size() > 0


def _tf_cluster_strategy() -> Any:
    """The `MultiWorkerMirroredStrategy` in scope, or `None`."""
    if "tensorflow" not in sys.modules:
        return None
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return strategy
    return None


def _torch_group_size() -> int:
    """The size of the initialised `torch.distributed` group, or 0."""
    if "torch" not in sys.modules:
        return 0
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_world_size()


def _gather(value: int) -> np.ndarray:
    """`value` from every process (just this one's, in one process)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        strategy = _tf_cluster_strategy()
        if strategy is not None:
            import tensorflow as tf

            # One value per replica, in replica order: a worker's replicas
            # repeat its value, which changes no least value or agreement.
            mine = strategy.experimental_distribute_values_from_function(
                lambda _: tf.constant([value], tf.int64)
            )
            return strategy.gather(mine, axis=0).numpy()
    elif backend == "torch":
        size = _torch_group_size()
        if size > 1:
            import torch
            import torch.distributed as dist

            cuda = dist.get_backend() == "nccl"  # NCCL gathers device tensors.
            tensor = torch.tensor([value], dtype=torch.int64)
            tensor = tensor.cuda() if cuda else tensor
            values = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(values, tensor)
            return np.asarray([int(v.item()) for v in values], np.int64)
    elif backend == "jax":
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            from keras_ft.compat import gather_ints

            # The coordination service's store: a millisecond, where an
            # all-gather is compiled and run.
            values = gather_ints(value)
            if values is not None:
                return values
            return np.asarray(multihost_utils.process_allgather(np.int64(value)))
    return np.asarray([value])


def _bounds(index: tuple, shape: tuple[int, ...]) -> Bounds:
    """A shard's index (a tuple of slices) as (start, stop) per dimension."""
    start, stop = [], []
    for part, size in zip(index, shape, strict=False):
        first, last, _ = part.indices(size)
        start.append(first)
        stop.append(last)
    # An index may leave out trailing dimensions: those are whole.
    for size in shape[len(index) :]:
        start.append(0)
        stop.append(size)
    return tuple(start), tuple(stop)


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or infinity; other types always do.

    The sum of an array with a NaN or an infinity is not finite, and one
    pass of summing costs much less than `isfinite()` and its mask; only an
    overflowing sum of finite values needs the exact check.
    """
    if array.dtype.kind != "f" and array.dtype != ml_dtypes.bfloat16:
        return True
    accumulate = np.float32 if array.dtype.itemsize < 4 else None
    if np.isfinite(np.add.reduce(array, dtype=accumulate)):
        return True
    return bool(np.isfinite(array).all())
