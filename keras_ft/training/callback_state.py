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
of that class, so the restarted script must pass the same callbacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import keras

# Keras keeps these in attributes, resetting them in `on_train_begin`.
STOCK_ATTRIBUTES: dict[type, tuple[str, ...]] = {
    keras.callbacks.EarlyStopping: (
        "wait",
        "stopped_epoch",
        "best",
        "best_weights",
        "best_epoch",
    ),
    keras.callbacks.ReduceLROnPlateau: ("wait", "best", "cooldown_counter"),
    keras.callbacks.ModelCheckpoint: ("best",),
    keras.callbacks.History: ("epoch", "history"),
}


def capture(callbacks: Iterable[keras.callbacks.Callback]) -> dict[str, Any]:
    """The state of every callback that has one, keyed by class and position."""
    states = {}
    for key, callback in keyed(callbacks):
        if _has_protocol(callback):
            states[key] = callback.get_state()
            continue
        attributes = _stock_attributes(callback)
        if attributes:
            states[key] = {
                name: getattr(callback, name)
                for name in attributes
                if hasattr(callback, name)
            }
    return states


def apply(callbacks: Iterable[keras.callbacks.Callback], states: dict) -> None:
    """Gives each callback its saved state; callbacks not in `states` keep theirs."""
    for key, callback in keyed(callbacks):
        if key not in states:
            continue
        state = states[key]
        if _has_protocol(callback):
            callback.set_state(state)
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
    for cls, attributes in STOCK_ATTRIBUTES.items():
        if isinstance(callback, cls):
            return attributes
    return ()
