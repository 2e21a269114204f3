"""What a process makes once from code alone, on first use: a compiled
executable per backend operation (`keras_ft.backend`), and Keras functions
wrapped with a cache (`keras_ft.compat`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Compiling costs a second or more; every save reuses the executable, so it
# lives as long as the process (as the code it was made from does).
_made: dict[str, Any] = {}


def made_once(name: str, make: Callable[[], Any]) -> Any:
    """What `make()` made the first time `name` was asked for."""
    found = _made.get(name)
    if found is None:
        found = _made[name] = make()
    return found
