"""Internals of Keras' `fit()` loop, its callbacks and its random state.

Each function names the internal it uses and falls back to the public
behaviour when this Keras lacks it (see `registry.py`).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import keras

from keras_ft.compat.registry import available, fail, register, usable


def code_names(function: Any) -> set[str]:
    """Names a function's code uses (attributes included), unwrapped."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return set(code.co_names) if code is not None else set()


@register(
    "initial_epoch",
    "completed epochs are skipped by reading their data without training, "
    "not jumped over",
)
def _check_initial_epoch() -> bool:
    # fit() reads `self._initial_epoch` after on_train_begin, as Keras' own
    # BackupAndRestore relies on.
    return "_initial_epoch" in code_names(keras.Model.fit)


def set_initial_epoch(model: keras.Model, epoch: int | None) -> bool:
    """Has the running `fit()` start at `epoch` (`None`: as it was told).

    Returns:
        Whether `fit()` will honour it; if not, the caller skips the epochs.
    """
    if epoch is not None and not usable("initial_epoch"):
        return False
    if available("initial_epoch"):
        model._initial_epoch = epoch
    return True


@register(
    "metrics_build",
    "the metrics of an interrupted epoch restart at the resumed batch on TensorFlow",
)
def _check_metrics_build() -> bool:
    return callable(getattr(keras.Model, "_symbolic_build", None))


def build_metrics(model: keras.Model, batch: Any) -> bool:
    """Builds the compiled metrics from a data batch, before the first step.

    TensorFlow builds them inside the first training step, too late to give
    them the values of an interrupted epoch.
    """
    if not usable("metrics_build"):
        return False
    try:
        model._symbolic_build(data_batch=batch)
    except Exception as e:
        fail("metrics_build", e)
        return False
    return True


@register(
    "callback_list",
    "the state of other callbacks (EarlyStopping, ReduceLROnPlateau, "
    "ModelCheckpoint, History, get_state()) is not backed up",
)
def _check_callback_list() -> bool:
    return hasattr(sys, "_getframe") and hasattr(keras.callbacks, "CallbackList")


def calling_callback_list(
    callback: keras.callbacks.Callback,
) -> keras.callbacks.CallbackList | None:
    """The `CallbackList` calling `callback.on_train_begin()`, if found.

    fit() gives callbacks no handle on each other; it is a few frames up.
    """
    if not usable("callback_list"):
        return None
    # None when called by hand, outside fit().
    return local_up_the_stack(
        sys._getframe(1),
        6,
        "self",
        lambda owner: (
            isinstance(owner, keras.callbacks.CallbackList)
            and any(c is callback for c in owner.callbacks)
        ),
    )


def local_up_the_stack(
    frame: Any, depth: int, name: str, accept: Callable[[Any], bool]
) -> Any:
    """The local variable `name` of `frame` or of the `depth - 1` frames
    that called it, the nearest one that `accept()` takes, or `None`."""
    for _ in range(depth):
        if frame is None:
            break
        value = frame.f_locals.get(name)
        if accept(value):
            return value
        frame = frame.f_back
    return None


# Stock callbacks' counters kept in private attributes, by class: a resumed
# fit() continues them (`training/callback_state.py`).
_PRIVATE_COUNTERS: dict[str, tuple[str, ...]] = {
    "TensorBoard": ("_global_train_batch", "_global_test_batch"),
    "ModelCheckpoint": ("_batches_seen_since_last_saving", "_last_batch_seen"),
}


def _uses(cls: type, names: tuple[str, ...]) -> bool:
    used = set().union(*(code_names(f) for f in vars(cls).values() if callable(f)))
    return set(names) <= used


@register("tensorboard_steps", "TensorBoard's step axis restarts after a resume")
def _check_tensorboard_steps() -> bool:
    return _uses(keras.callbacks.TensorBoard, _PRIVATE_COUNTERS["TensorBoard"])


@register(
    "checkpoint_batches",
    "ModelCheckpoint(save_freq=N) counts its N batches afresh after a resume",
)
def _check_checkpoint_batches() -> bool:
    checkpoint = keras.callbacks.ModelCheckpoint
    return callable(getattr(checkpoint, "_should_save_on_batch", None)) and _uses(
        checkpoint, _PRIVATE_COUNTERS["ModelCheckpoint"]
    )


def tensorboard_batches(board: Any) -> int | None:
    """The training batches a `TensorBoard` callback has counted (its
    `_global_train_batch`), or `None` where this Keras has no such count."""
    if "_global_train_batch" not in private_counters("TensorBoard"):
        return None
    return int(getattr(board, "_global_train_batch", 0))


def set_tensorboard_batches(board: Any, count: int) -> None:
    """Has a `TensorBoard` callback count training batches from `count`."""
    if "_global_train_batch" in private_counters("TensorBoard"):
        board._global_train_batch = count


def count_checkpoint_batch(checkpoint: Any, batch: int) -> None:
    """Has a `ModelCheckpoint` count the end of `batch` as its own batch
    end does, without saving (its `_should_save_on_batch()`)."""
    if usable("checkpoint_batches"):
        try:
            checkpoint._should_save_on_batch(batch)
        except Exception as e:
            fail("checkpoint_batches", e)


def private_counters(kind: str) -> tuple[str, ...]:
    """The private attributes in which Keras' `kind` callback counts batches,
    where this Keras has them (`()` otherwise)."""
    capability = {
        "TensorBoard": "tensorboard_steps",
        "ModelCheckpoint": "checkpoint_batches",
    }
    if kind in capability and usable(capability[kind]):
        return _PRIVATE_COUNTERS[kind]
    return ()


@register(
    "swap_ema",
    "a backup taken while SwapEMAWeights has the moving averages swapped in holds "
    "them as the model's weights",
)
def _check_swap_ema() -> bool:
    swap = getattr(keras.callbacks, "SwapEMAWeights", None)
    return swap is not None and callable(getattr(swap, "_swap_variables", None))


def swapped_in(callbacks: list) -> list:
    """The `SwapEMAWeights` callbacks whose moving averages are in the model now."""
    swap = getattr(keras.callbacks, "SwapEMAWeights", None)
    found = [
        c
        for c in callbacks
        if swap is not None
        and isinstance(c, swap)
        and getattr(c, "_ema_weights_in_model", False)
    ]
    return found if found and usable("swap_ema") else []


def swap_ema(callback: Any) -> None:
    """Swaps the model's weights with the optimizer's moving averages (the
    swap is its own inverse)."""
    callback._swap_variables()


@register(
    "tensorboard_events",
    "TensorBoard shows both the killed run's values past its last backup and "
    "the resumed run's, at the same steps",
)
def _check_tensorboard_events() -> bool:
    from tensorboard.backend.event_processing import event_file_loader  # noqa: F401
    from tensorboard.compat.proto import event_pb2  # noqa: F401
    from tensorboard.summary.writer import record_writer  # noqa: F401

    return True


def tensorboard_dirs(board: Any) -> tuple[str, str]:
    """Where a `TensorBoard` callback writes its training and validation
    events (Keras' `_train_dir`, `_val_dir`; else as Keras names them)."""
    root = str(getattr(board, "log_dir", "logs"))
    return (
        str(getattr(board, "_train_dir", os.path.join(root, "train"))),
        str(getattr(board, "_val_dir", os.path.join(root, "validation"))),
    )


def read_events(paths: Any) -> list:
    """The summary events in TensorBoard event files, in order, as
    TensorBoard's own reader keeps them: a `SessionLog` START after the
    first drops what came before it at or past its step."""
    from tensorboard.backend.event_processing import event_file_loader

    events: list = []
    started = False
    for path in paths:
        for event in event_file_loader.EventFileLoader(path).Load():
            if event.HasField("session_log") and event.session_log.status == 1:
                if started:
                    events = [e for e in events if e.step < event.step]
                started = True
            elif event.HasField("summary"):
                events.append(event)
    return events


def write_restart(path: str, step: int, events: list) -> None:
    """Writes a TensorBoard event file holding a `SessionLog` START at
    `step`, then `events` (appended to `path` if it exists).

    TensorBoard takes a run's first START for the session's start, and each
    later one for a restart: the START is written twice, so that it is a
    restart also where nothing wrote a START before.
    """
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer import record_writer

    now = time.time()
    start = event_pb2.Event(
        wall_time=now,
        step=step,
        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
    )
    records = [
        event_pb2.Event(wall_time=now, file_version="brain.Event:2"),
        start,
        start,
        *events,
    ]
    with open(path, "ab") as f:
        writer = record_writer.RecordWriter(f)
        for record in records:
            writer.write(record.SerializeToString())
        writer.flush()
        os.fsync(f.fileno())


@register("print_msg", "messages are printed with print(), not Keras' io_utils")
def _check_print_msg() -> bool:
    from keras.src.utils import io_utils

    return callable(io_utils.print_msg)


def print_msg(message: str) -> None:
    """Prints as Keras' own callbacks do (stdout, or absl logging)."""
    if usable("print_msg"):
        from keras.src.utils import io_utils

        try:
            io_utils.print_msg(message)
            return
        except Exception as e:
            fail("print_msg", e)
    sys.stdout.write(message + "\n")  # One write, as Keras does: a whole line.
    sys.stdout.flush()


@register(
    "stack_frames",
    "a preemption handler left by a fit() that raised does not step aside "
    "by itself (Ctrl-C then still asks for a backup until the next fit())",
)
def _check_stack_frames() -> bool:
    return hasattr(sys, "_getframe") and hasattr(sys._getframe(), "f_locals")


def current_frame() -> Any:
    """The caller's frame, or `None` where frames cannot be walked."""
    return sys._getframe(1) if available("stack_frames") else None


def main_thread_frame() -> Any:
    """The main thread's current frame, seen from another thread, or `None`
    where it cannot be had (then `stack_holds()` assumes the training runs)."""
    if not usable("stack_frames") or not hasattr(sys, "_current_frames"):
        return _UNKNOWN_FRAME
    frame = sys._current_frames().get(threading.main_thread().ident)
    return _UNKNOWN_FRAME if frame is None else frame


# A frame that cannot be had: `stack_holds()` answers "still running".
_UNKNOWN_FRAME = object()


def stack_holds(frame: Any, obj: Any) -> bool:
    """Whether `frame` or a frame below it holds `obj` in a local variable.

    `True` when frames cannot be walked: the caller then assumes the
    training that holds `obj` is still running.
    """
    if not usable("stack_frames") or frame is _UNKNOWN_FRAME:
        return True
    while frame is not None:
        if any(value is obj for value in frame.f_locals.values()):
            return True
        frame = frame.f_back
    return False


def _jax_fit_names() -> set[str]:
    """The names and string constants of the JAX trainer's `fit()` (the
    JAX trainer's class is `keras.Model`'s base; its name has changed)."""
    code = inspect.unwrap(keras.Model.fit).__code__
    names = set(code.co_names) | set(code.co_varnames)
    for constant in code.co_consts:  # A dict's keys are one tuple constant.
        names.update(constant if isinstance(constant, tuple) else [constant])
    return {name for name in names if isinstance(name, str)}


@register(
    "jax_step_state",
    "StopAtStep may stop one step short of `last_step` where a "
    "LossScaleOptimizer skips the step due to reach it",
    applies=lambda: keras.backend.backend() == "jax",
)
def _check_jax_step_state() -> bool:
    # fit() unpacks the state its train function returns: the optimizer's
    # variables, in `optimizer.variables`' order, are its third part.
    return {"train_function", "optimizer_variables"} <= _jax_fit_names()


@register(
    "jax_live_state",
    "NanGuard syncs JAX's training state into the model's variables at every "
    "batch (a Python loop over them) to check the weights",
    applies=lambda: keras.backend.backend() == "jax",
)
def _check_jax_live_state() -> bool:
    # fit() keeps the state its last step returned in `_jax_state` (a dict
    # with "trainable_variables", in `trainable_variables`' order) until a
    # callback syncs it (`_jax_state_synced`).
    return {"_jax_state", "_jax_state_synced", "trainable_variables"} <= (
        _jax_fit_names()
    )


def live_trainable_values(model: keras.Model) -> list | None:
    """On JAX, inside `fit()`: the trainable variables' values as the last
    step left them, without syncing the state into the model's variables
    (which the next step would gather back); `None` where there is no such
    state (other backends, outside a step, already synced): the variables
    themselves are current then."""
    if keras.backend.backend() != "jax" or not usable("jax_live_state"):
        return None
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return None
    try:
        values = state["trainable_variables"]
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"trainable_variables is a {type(values).__name__}")
        return list(values)
    except (KeyError, TypeError) as e:
        fail("jax_live_state", e)
        return None


def step_after(
    result: Any, model: keras.Model, read: Callable[[keras.Model], int]
) -> int | None:
    """The optimizer's step once a call of `model.train_function` returned
    `result` (waits for the step); `None` where it cannot be read.

    On JAX the step is in the state the call returned (`(logs, state)`,
    not yet the model's variables); elsewhere the variable holds it, and
    `read(model)` (the caller's reader of it) reads it."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    if keras.backend.backend() != "jax":
        return read(model)
    iterations = optimizer.iterations
    if not usable("jax_step_state"):
        return None
    try:
        _, state = result
        values = state[2]
        for variable, value in zip(optimizer.variables, values, strict=True):
            if variable is iterations:
                return int(keras.ops.convert_to_numpy(value))
        raise ValueError("the optimizer's iterations are not among its variables")
    except (TypeError, ValueError, IndexError) as e:
        fail("jax_step_state", e)
        return None


@register(
    "keras_global_rng",
    "Keras' global random generator (keras.random calls without a seed "
    "generator) does not continue its stream after a resume",
)
def _check_keras_global_rng() -> bool:
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return callable(global_state.get_global_attribute) and callable(
        seed_generator.global_seed_generator
    )


def keras_global_seed_state() -> Any:
    """The state variable of Keras' global `SeedGenerator`, if it exists.

    Only if something already created it: creating it would draw a seed from
    Python's generator and change the stream being saved.
    """
    if not usable("keras_global_rng"):
        return None
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
    return None if generator is None else generator.state


def set_keras_global_seed_state(value: Any) -> None:
    """Sets the state of Keras' global `SeedGenerator`, creating it if need be."""
    if not usable("keras_global_rng"):
        return
    from keras.src.random.seed_generator import global_seed_generator

    global_seed_generator().state.assign(value)


@register(
    "tf_op_determinism",
    "keras-ft cannot tell whether tf.config.experimental.enable_op_determinism() "
    "was called (only TF_DETERMINISTIC_OPS=1 is seen), and may say a TensorFlow "
    "GPU run is not reproducible when it is",
    applies=lambda: keras.backend.backend() == "tensorflow" and _tf_has_gpu(),
)
def _check_tf_op_determinism() -> bool:
    from tensorflow.python.framework import config

    return callable(config.is_op_determinism_enabled)


def tf_op_determinism() -> bool:
    """Whether TensorFlow's ops are deterministic (`enable_op_determinism()`)."""
    import os

    if os.environ.get("TF_DETERMINISTIC_OPS", "").lower() in ("1", "true"):
        return True
    if not usable("tf_op_determinism"):
        return False
    from tensorflow.python.framework import config

    try:
        return bool(config.is_op_determinism_enabled())
    except Exception as e:  # Moved or changed: the public signal alone.
        fail("tf_op_determinism", e)
        return False


def _tf_has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_logical_devices("GPU"))


@register(
    "optimizer_var_list",
    "an optimizer kept in a model's attribute (a GAN's `d_optimizer`) is not "
    "restored when it is built by its first step only",
)
def _check_optimizer_var_list() -> bool:
    # Read from the code: building an optimizer here would take a name (and
    # make a variable) before the user's.
    return "_trainable_variables" in code_names(keras.optimizers.Optimizer.build)


def optimizer_var_list(optimizer: Any) -> list | None:
    """The variables a built optimizer steps (`build()`'s argument), or
    `None` where this Keras keeps them elsewhere (warned once)."""
    if not usable("optimizer_var_list"):
        return None
    try:
        return list(optimizer._trainable_variables)
    except Exception as e:
        fail("optimizer_var_list", e)
        return None
