"""One compiled executable per backend operation, made on first use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Compiling costs a second or more; every save reuses the executable, so it
# lives as long as the process.
_compiled: dict[str, Any] = {}


def compiled(name: str, make: Callable[[], Any]) -> Any:
    """The executable `name`, made by `make()` the first time it is asked for."""
    found = _compiled.get(name)
    if found is None:
        found = _compiled[name] = make()
    return found
