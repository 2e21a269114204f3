"""Other callbacks' state across a restart.

Keras' stock callbacks that carry state from one epoch to the next are saved
and restored attribute by attribute. Any other callback takes part by defining
two methods, and is otherwise left alone:

```python
class MyCallback(keras.callbacks.Callback):
    def get_state(self) -> dict:
        # JSON values and NumPy arrays only.
        return {"seen": self.seen}

    def set_state(self, state: dict) -> None:
        self.seen = state["seen"]
```

Callbacks are matched between runs by class name and position among callbacks
of that class, so the restarted script must pass the same callbacks. A
callback that keeps attributes of its own but has neither method is named in
a warning at a fit()'s first save: a resume gives it a fresh state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras
import numpy as np

from keras_ft import compat, events
from keras_ft.state import arrays, saved_state
from keras_ft.training import neighbours


def _history_state(history: keras.callbacks.History) -> dict[str, Any]:
    logged = {
        key: [_loggable(key, value) for value in values]
        for key, values in getattr(history, "history", {}).items()
    }
    return {"epoch": list(getattr(history, "epoch", [])), "history": logged}


def _set_history_state(history: keras.callbacks.History, state: dict) -> None:
    for name in ("epoch", "history"):
        if name in state:
            setattr(history, name, state[name])


def _loggable(key: str, value: Any) -> Any:
    """A value `History` logged, as a backup can hold it: a backend tensor or
    NumPy value (another callback's addition to the logs) as NumPy's."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    try:
        array = keras.ops.convert_to_numpy(value)
    except Exception:  # Not an array at all.
        array = None
    if isinstance(array, np.ndarray) and array.dtype.kind in "biuf":
        return array if array.ndim else array[()]
    events.warn(
        "save",
        f"BackupAndRestore: History logged {key!r} as a value of type "
        f"{type(value).__name__}, which a backup cannot hold: a resumed fit()'s "
        "History has None there. Log numbers, strings or arrays.",
        stacklevel=6,
    )
    return None


# Keras keeps these in attributes, resetting them in `on_train_begin`; the
# fields, and how a saved value of each must look, are `saved_state`'s.
_STOCK_KINDS: dict[type, str] = {
    keras.callbacks.EarlyStopping: "EarlyStopping",
    keras.callbacks.ReduceLROnPlateau: "ReduceLROnPlateau",
    keras.callbacks.ModelCheckpoint: "ModelCheckpoint",
    keras.callbacks.TensorBoard: "TensorBoard",
}
# Stock callbacks whose state is not in attributes: how to read and set it.
_STOCK_STATES: dict[type, tuple[str, Callable, Callable]] = {
    keras.callbacks.CSVLogger: (
        "CSVLogger",
        neighbours.csv_state,
        neighbours.set_csv_state,
    ),
    keras.callbacks.History: ("History", _history_state, _set_history_state),
}
# Modules whose callbacks are known here, stateless or saved as above.
_KNOWN_MODULES = ("keras.", "keras_ft.", "keras_hub.", "keras_tuner.")
_BASE_ATTRIBUTES = frozenset(vars(keras.callbacks.Callback())) | {"async_safe"}


def capture(callbacks: Iterable[keras.callbacks.Callback]) -> dict[str, Any]:
    """The state of every callback that has one, keyed by class and position."""
    states = {}
    for key, callback in keyed(callbacks):
        if _has_protocol(callback):
            states[key] = callback.get_state()
            arrays.check_tree(states[key], f"{key}'s get_state()")
            continue
        stock = _stock_state(callback)
        if stock is not None:
            states[key] = stock[1](callback)
            continue
        attributes = _stock_attributes(callback)
        if attributes:
            states[key] = {
                name: getattr(callback, name)
                for name in attributes
                if hasattr(callback, name)
            }
    return states


def check(callbacks: Iterable[keras.callbacks.Callback], states: Any) -> None:
    """Raises `ValueError` unless each stock callback's saved state has the
    fields Keras keeps, of their types (`saved_state.check_callback()`;
    `EarlyStopping.best_weights` of the model's shapes). Callbacks with
    `get_state()` / `set_state()` check their own.
    """
    if not isinstance(states, dict):
        raise ValueError("the callbacks' state is not an object")
    for key, callback in keyed(callbacks):
        kind = _stock_kind(callback)
        if key not in states or kind is None or _has_protocol(callback):
            continue
        model = getattr(callback, "model", None)
        shapes = None if model is None else [tuple(w.shape) for w in model.weights]
        saved_state.check_callback(kind, key, states[key], shapes)


def apply(callbacks: Iterable[keras.callbacks.Callback], states: dict) -> None:
    """Gives each callback its saved state; callbacks not in `states` keep theirs."""
    for key, callback in keyed(callbacks):
        if key not in states:
            continue
        state = states[key]
        stock = _stock_state(callback)
        if _has_protocol(callback):
            callback.set_state(state)
        elif stock is not None:
            stock[2](callback, state)
        else:
            for name in _stock_attributes(callback):
                if name in state:
                    setattr(callback, name, state[name])


def keyed(
    callbacks: Iterable[keras.callbacks.Callback],
) -> Iterator[tuple[str, keras.callbacks.Callback]]:
    """Each callback with its key, `"<class name>:<position in its class>"`."""
    seen: dict[str, int] = {}
    for callback in callbacks:
        name = type(callback).__name__
        index = seen.get(name, 0)
        seen[name] = index + 1
        yield f"{name}:{index}", callback


def _has_protocol(callback: Any) -> bool:
    return callable(getattr(callback, "get_state", None)) and callable(
        getattr(callback, "set_state", None)
    )


def _stock_attributes(callback: Any) -> tuple[str, ...]:
    kind = _stock_kind(callback)
    if kind is None or _stock_state(callback) is not None:
        return ()
    # Private ones only where this Keras keeps them (`compat`).
    public = [n for n in saved_state.CALLBACK_FIELDS[kind] if not n.startswith("_")]
    return (*public, *compat.private_counters(kind))


def _stock_state(callback: Any) -> tuple[str, Callable, Callable] | None:
    for cls, stock in _STOCK_STATES.items():
        if isinstance(callback, cls):
            return stock
    return None


def _stock_kind(callback: Any) -> str | None:
    stock = _stock_state(callback)
    if stock is not None:
        return stock[0]
    for cls, kind in _STOCK_KINDS.items():
        if isinstance(callback, cls):
            return kind
    return None


def catch_up(callbacks: list, behind: list, batch: int) -> None:
    """Has each `ModelCheckpoint` keyed in `behind` (saved before its end of
    the epoch's `batch`-th batch ran) count that batch, as it did in the run
    that was saved: its next checkpoint comes where it would have."""
    for key, callback in keyed(callbacks):
        if key in behind and isinstance(callback, keras.callbacks.ModelCheckpoint):
            compat.count_checkpoint_batch(callback, batch - 1)


def warn_unsaved(callbacks: list, states: dict) -> None:
    """Warns, naming them, of the callbacks that keep attributes of their
    own but have no state in `states` (a save's `capture()`): a resume
    cannot give them back what they had."""
    names = [
        key
        for key, callback in keyed(callbacks)
        if key not in states
        and not type(callback).__module__.startswith(_KNOWN_MODULES)
        and set(vars(callback)) - _BASE_ATTRIBUTES
    ]
    if names:
        events.warn(
            "save",
            f"BackupAndRestore: the state of {', '.join(names)} is not backed up "
            "(no get_state()/set_state()): a resumed fit() gives it a fresh one. "
            "Define both methods to carry it (JSON values and NumPy arrays; "
            "see keras_ft.training.callback_state).",
            stacklevel=5,
        )


def is_stateful(callback: keras.callbacks.Callback) -> bool:
    """Whether `callback` keeps state across epochs that a backup carries.

    History is left out: `with_epoch_recorded()` fills in the epoch it has
    not yet seen; so is TensorBoard, whose counters change at batches only.
    """
    unchanged = (keras.callbacks.History, keras.callbacks.TensorBoard)
    return not isinstance(callback, unchanged) and bool(capture([callback]))


def with_epoch_recorded(
    callbacks: list, epoch: int, logs: dict | None, batch: int | None
) -> list:
    """The callbacks, with a History that has not yet seen `epoch` brought up."""
    if batch is not None:
        return callbacks
    result = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.History) and epoch not in getattr(
            callback, "epoch", [epoch]
        ):
            updated = keras.callbacks.History()
            updated.epoch = [*callback.epoch, epoch]
            updated.history = {k: list(v) for k, v in callback.history.items()}
            for key, value in (logs or {}).items():
                updated.history.setdefault(key, []).append(value)
            callback = updated
        result.append(callback)
    return result


class FitCallbacks:
    """The other callbacks of one `fit()`, and a hook after the last of them.

    fit() gives callbacks no handle on each other; `compat` finds the
    `CallbackList`. A hook added at its end runs `after_all(epoch, logs)`
    once every callback's `on_epoch_end` has run: the point where an epoch
    is really over.

    Args:
        owner: The callback asking.
        callback_list: This fit()'s `CallbackList`, or `None` if not found.
        after_all: Called at the end of each epoch, after every callback.
    """

    def __init__(
        self,
        owner: keras.callbacks.Callback,
        callback_list: keras.callbacks.CallbackList | None,
        after_all: Callable[[int, dict | None], None],
    ):
        self.owner = owner
        self.others: list[keras.callbacks.Callback] = []
        self._later: list[keras.callbacks.Callback] = []
        if callback_list is None:
            return
        callbacks = callback_list.callbacks
        mine = [c for c in callbacks if isinstance(c, _AfterAll) and c.owner is owner]
        self.others = [
            c for c in callbacks if c is not owner and not isinstance(c, _AfterAll)
        ]
        if owner in callbacks:
            later = callbacks[callbacks.index(owner) + 1 :]
            self._later = [c for c in later if c in self.others]
        # A new list, not an append: CallbackList is iterating the old one.
        callback_list.callbacks = [c for c in callbacks if c not in mine] + [
            _AfterAll(owner, after_all)
        ]

    def later_stateful(self) -> list[keras.callbacks.Callback]:
        """The stateful callbacks whose on_epoch_end runs after the owner's."""
        return [c for c in self._later if is_stateful(c)]

    def later_batch_counters(self) -> list[keras.callbacks.Callback]:
        """The `ModelCheckpoint`s whose batch end runs after the owner's: at
        a save in a batch's end they have not yet counted that batch."""
        return [
            c for c in self._later if isinstance(c, keras.callbacks.ModelCheckpoint)
        ]

    def keys(self, callbacks: list[keras.callbacks.Callback]) -> list[str]:
        """The state keys of `callbacks` (see `keyed()`)."""
        return [key for key, c in keyed(self.others) if c in callbacks]


class _AfterAll(keras.callbacks.Callback):
    """Runs last in the CallbackList."""

    def __init__(
        self,
        owner: keras.callbacks.Callback,
        after_all: Callable[[int, dict | None], None],
    ):
        super().__init__()
        self.owner = owner
        self.after_all = after_all

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.after_all(epoch, logs)
