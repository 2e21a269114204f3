"""What a checkpoint's saved state (`ResumePoint.extra`) must look like,
checked without Keras: `keras-ft verify`, `watch()` and a restore agree on
which checkpoint is damaged.

A backup is untrusted input: the generator states, the last batch's logs,
the input's position and Keras' stock callbacks' fields are checked by type
(and size) before anything is set, so that a malformed one is damage (a
restore falls back) rather than an error in the middle of training. A
callback is known here by its class name (`"History:0"`); a restore also
checks each callback of the `fit()` by what it is (`callback_state.check()`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keras_ft.state import generators


def check(state: dict) -> None:
    """Raises `ValueError` naming the first part of `state` (a checkpoint's
    saved state, arrays joined in) that is malformed."""
    saved_input = state.get("input", {})
    if not isinstance(saved_input, dict):
        raise ValueError("the input's position is not an object")
    for saved in (
        state.get("rng", {}),
        state.get("epoch_begin_rng", {}),
        saved_input.get("rng", {}),
        saved_input.get("stream_rng", {}),
    ):
        generators.check(saved)
    if not _is_count(saved_input.get("stream", 0)):
        raise ValueError("the input's stream position is not a count")
    if not isinstance(saved_input.get("stream_made", False), bool):
        raise ValueError("the input's stream_made is not true or false")
    for name in ("tf_iterator", "grain"):
        value = saved_input.get(name)
        if value is not None and not (
            isinstance(value, np.ndarray) and value.dtype == np.uint8
        ):
            raise ValueError(f"the input's {name} state is not bytes")
    logs = state.get("logs", {})
    if not isinstance(logs, dict) or not all(
        v is None or is_number(v) for v in logs.values()
    ):
        raise ValueError("the logs are not an object of numbers")
    if not _is_count(state.get("epoch_batches", 0)):
        raise ValueError("the epoch's batch count is not a count")
    fit = state.get("fit", 1)
    if not _is_count(fit) or fit < 1:
        raise ValueError("the fit() number is not a positive count")
    for field in ("callbacks_pending", "callbacks_behind"):
        names = state.get(field, [])
        if not isinstance(names, list) or not all(isinstance(k, str) for k in names):
            raise ValueError(f"{field} is not a list of names")
    histories = state.get("histories", [])
    if not isinstance(histories, list):
        raise ValueError("the earlier fits' histories are not a list")
    for number, history in enumerate(histories, start=1):
        check_callback("History", f"fit() #{number}'s History", history)
    callbacks = state.get("callbacks", {})
    if not isinstance(callbacks, dict):
        raise ValueError("the callbacks' state is not an object")
    for key, saved in callbacks.items():
        kind = key.rpartition(":")[0]
        if kind in CALLBACK_FIELDS:
            check_callback(kind, key, saved)


def check_callback(
    kind: str, key: str, saved: Any, weight_shapes: list[tuple] | None = None
) -> None:
    """Raises `ValueError` unless `saved` has the fields Keras' `kind`
    callback keeps, of their types; `weight_shapes`: the model's, for
    `EarlyStopping.best_weights`, where known."""
    if not isinstance(saved, dict):
        raise ValueError(f"the state of {key} is not an object")
    for name, (valid, what) in CALLBACK_FIELDS[kind].items():
        if name in saved and not valid(saved[name], weight_shapes):
            raise ValueError(f"{key}.{name} is not {what}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any, shapes: Any = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_best(value: Any, shapes: Any) -> bool:
    return value is None or is_number(value)


def _is_batch_seen(value: Any, shapes: Any = None) -> bool:
    return value is None or _is_count(value)


def _is_text(value: Any, shapes: Any = None) -> bool:
    return isinstance(value, str)


def _is_weights(value: Any, shapes: list[tuple] | None) -> bool:
    if value is None:
        return True
    return (
        isinstance(value, list)
        # An HDF5 scalar dataset reads back as a NumPy scalar.
        and all(isinstance(v, (np.ndarray, np.generic)) for v in value)
        and (shapes is None or [np.shape(v) for v in value] == shapes)
    )


def _is_epochs(value: Any, shapes: Any) -> bool:
    return isinstance(value, list) and all(_is_count(v) for v in value)


def _is_history(value: Any, shapes: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, list) and all(x is None or _is_log(x) for x in v)
        for v in value.values()
    )


def _is_log(value: Any) -> bool:
    # Keras logs a metric of several values (`F1Score()` per class) as the
    # array `float()` could not turn into a number; another callback may add
    # text, or a flag.
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype.kind in "biuf"
    return isinstance(value, (str, int, float))


# A check of a saved value (given the model's weight shapes, where known),
# and what the value must be, for the error.
_Field = tuple[Callable[[Any, Any], bool], str]
_COUNT: _Field = (_is_count, "a count")
_BEST: _Field = (_is_best, "a number or null")

# The attributes in which Keras' stock callbacks keep state from one epoch to
# the next (resetting them in `on_train_begin`), by class name.
CALLBACK_FIELDS: dict[str, dict[str, _Field]] = {
    "EarlyStopping": {
        "wait": _COUNT,
        "stopped_epoch": _COUNT,
        "best": _BEST,
        "best_weights": (_is_weights, "null or the model's weights"),
        "best_epoch": _COUNT,
    },
    "ReduceLROnPlateau": {
        "wait": _COUNT,
        "best": _BEST,
        "cooldown_counter": _COUNT,
    },
    "ModelCheckpoint": {
        "best": _BEST,
        "_batches_seen_since_last_saving": _COUNT,
        "_last_batch_seen": (_is_batch_seen, "null or a count"),
    },
    "TensorBoard": {"_global_train_batch": _COUNT, "_global_test_batch": _COUNT},
    # Not attributes: the text of the CSV file written up to the save.
    "CSVLogger": {"rows": (_is_text, "text")},
    "History": {
        "epoch": (_is_epochs, "a list of epoch numbers"),
        "history": (_is_history, "an object of lists of logged values"),
    },
}
