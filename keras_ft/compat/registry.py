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


@dataclasses.dataclass
class _Status:
    """What this process has learned of one capability."""

    capability: Capability
    works: bool | None = None  # The check's verdict, once it ran.
    failed: str | None = None  # Why a use raised.
    disabled_here: bool = False  # Inside a `disabled()` block.
    warned: bool = False


# What this process's Keras, TensorFlow and JAX have: the same for every
# training in it, so learned and said once per process.
_known: dict[str, _Status] = {}


def register(
    name: str, lost: str, applies: Callable[[], bool] | None = None
) -> Callable[[Callable[[], bool]], Callable[[], bool]]:
    """Decorates a check function, registering the capability it checks."""

    def decorate(check: Callable[[], bool]) -> Callable[[], bool]:
        _known[name] = _Status(Capability(name, lost, check, applies or (lambda: True)))
        return check

    return decorate


def names() -> list[str]:
    return sorted(_known)


def available(name: str) -> bool:
    """Whether `name` can be used here (checked once); never warns."""
    status = _known[name]
    if status.disabled_here or status.failed or name in _disabled_by_env():
        return False
    if status.works is None:
        try:
            status.works = bool(status.capability.check())
        except Exception:  # A check that cannot run is a missing internal.
            status.works = False
    return status.works


def usable(name: str) -> bool:
    """`available()`, warning once (naming what is lost) when it is not."""
    if available(name):
        return True
    warn_lost(name)
    return False


def fail(name: str, error: BaseException) -> None:
    """Marks `name` unavailable after a use raised, and warns once."""
    _known[name].failed = f"{type(error).__name__}: {error}"
    warn_lost(name)


def warn_lost(name: str) -> None:
    status = _known[name]
    if status.warned:
        return
    status.warned = True
    if status.disabled_here or name in _disabled_by_env():
        why = f"turned off by {DISABLE_ENV}"
    elif status.failed:
        why = f"using it raised {status.failed}"
    else:
        why = "its internals moved"
    events.warn(
        "compat",
        f"keras-ft: {status.capability.lost} (Keras {keras.__version__}: {why}; "
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
    for name, status in sorted(_known.items()):
        try:
            applies = status.capability.applies()
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
    unknown = set(capabilities) - set(_known)
    if unknown:
        raise ValueError(
            f"Unknown keras-ft capabilities {sorted(unknown)}; known: {names()}."
        )
    # Those not off already: each with whether it had warned before.
    added = {
        name: _known[name].warned
        for name in capabilities
        if not _known[name].disabled_here
    }
    for name in added:
        _known[name].disabled_here, _known[name].warned = True, False
    try:
        yield
    finally:
        for name, warned in added.items():
            _known[name].disabled_here, _known[name].warned = False, warned


def _disabled_by_env() -> set[str]:
    value = os.environ.get(DISABLE_ENV, "")
    requested = {n.strip() for n in value.split(",") if n.strip()}
    return set(_known) if "all" in requested else requested
