"""Which Keras internals this installation can use, and what is lost without.

Each capability is a named use of private Keras, TensorFlow or CPython names,
checked once (on first use) against what this installation offers. Where a
check fails, or a use raises, keras-ft takes the capability's public-API
fallback and warns once, naming what is lost; a backup never stops because
an internal moved.

`KERAS_FT_COMPAT_DISABLE` (comma-separated names, or `all`) turns
capabilities off, to work around an internal that misbehaves on a new
Keras; `disabled()` does the same inside a block (the tests use it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import keras

from keras_ft import events
from keras_ft.errors import CompatibilityWarning

DISABLE_ENV = "KERAS_FT_COMPAT_DISABLE"


@dataclasses.dataclass(frozen=True)
class Capability:
    """A use of internals, with the check that it works on this installation.

    Attributes:
        name: Short name, as `KERAS_FT_COMPAT_DISABLE` takes it.
        lost: What a user loses when it is unavailable, as a sentence part.
        check: Returns whether the internals are there and look as expected.
        applies: Whether the capability matters here (backend, cluster).
    """

    name: str
    lost: str
    check: Callable[[], bool]
    applies: Callable[[], bool] = lambda: True


# What this process's Keras, TensorFlow and JAX have: the same for every
# training in it, so learned and said once per process.
_CAPABILITIES: dict[str, Capability] = {}
_checked: dict[str, bool] = {}
_failed: dict[str, str] = {}  # Name: why a use raised.
_disabled_here: set[str] = set()
_warned: set[str] = set()


def register(
    name: str, lost: str, applies: Callable[[], bool] | None = None
) -> Callable[[Callable[[], bool]], Callable[[], bool]]:
    """Decorates a check function, registering the capability it checks."""

    def decorate(check: Callable[[], bool]) -> Callable[[], bool]:
        _CAPABILITIES[name] = Capability(name, lost, check, applies or (lambda: True))
        return check

    return decorate


def names() -> list[str]:
    return sorted(_CAPABILITIES)


def available(name: str) -> bool:
    """Whether `name` can be used here (checked once); never warns."""
    if name in _disabled_here or name in _failed or name in _disabled_by_env():
        return False
    if name not in _checked:
        try:
            _checked[name] = bool(_CAPABILITIES[name].check())
        except Exception:  # A check that cannot run is a missing internal.
            _checked[name] = False
    return _checked[name]


def usable(name: str) -> bool:
    """`available()`, warning once (naming what is lost) when it is not."""
    if available(name):
        return True
    warn_lost(name)
    return False


def fail(name: str, error: BaseException) -> None:
    """Marks `name` unavailable after a use raised, and warns once."""
    _failed[name] = f"{type(error).__name__}: {error}"
    warn_lost(name)


def warn_lost(name: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    capability = _CAPABILITIES[name]
    if name in _disabled_here or name in _disabled_by_env():
        why = f"turned off by {DISABLE_ENV}"
    elif name in _failed:
        why = f"using it raised {_failed[name]}"
    else:
        why = "its internals moved"
    events.warn(
        "compat",
        f"keras-ft: {capability.lost} (Keras {keras.__version__}: {why}; "
        f"capability {name!r}). Backups and resumes still work.",
        CompatibilityWarning,
        stacklevel=3,
    )


def probe(warn: bool = True) -> dict[str, bool]:
    """Checks every capability that applies here; warns once for each missing.

    Returns:
        `{name: available}` for the capabilities that apply.
    """
    found = {}
    for name, capability in sorted(_CAPABILITIES.items()):
        try:
            applies = capability.applies()
        except Exception:
            applies = False
        if not applies:
            continue
        found[name] = available(name)
        if warn and not found[name]:
            warn_lost(name)
    return found


@contextlib.contextmanager
def disabled(*capabilities: str) -> Iterator[None]:
    """Makes `capabilities` unavailable inside the block, as on a Keras
    without them; each warns again on its first use there."""
    unknown = set(capabilities) - set(_CAPABILITIES)
    if unknown:
        raise ValueError(
            f"Unknown keras-ft capabilities {sorted(unknown)}; known: {names()}."
        )
    added = set(capabilities) - _disabled_here
    _disabled_here.update(added)
    warned = _warned & added
    _warned.difference_update(added)
    try:
        yield
    finally:
        _disabled_here.difference_update(added)
        _warned.difference_update(added)
        _warned.update(warned)


def _disabled_by_env() -> set[str]:
    value = os.environ.get(DISABLE_ENV, "")
    requested = {n.strip() for n in value.split(",") if n.strip()}
    return set(_CAPABILITIES) if "all" in requested else requested
