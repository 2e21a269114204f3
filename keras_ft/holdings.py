"""What this process holds in each directory, across its fit() calls.

Nearly everything keras-ft keeps belongs to one training (its state, its
writer) and goes with it. What must outlive a `fit()` concerns a directory,
and is kept here, by kind and path, so that one table says what a process
holds between two fits:

- `"lock"`: a backup directory's `flock` (`DirectoryLock`), by the lock
  file's real path. Keras calls no `on_train_end` for a fit() that raised:
  the next fit() on the directory in this process (a notebook cell run
  again) takes the lock over instead of reporting another writer.
- `"lease"`: a bucket prefix's lease (`RemoteLease`), for the same reason;
  the later fit() stops the earlier one's heartbeat.
- `"scratch"`: the lock descriptor of a scratch directory this process
  made, held until the directory is removed; the kernel drops it when the
  process dies, which is how a later process knows to remove the directory.
- `"writer"`: the training writing a chief directory (its `SaveQueue`):
  the next training there first waits for that one's writes, then closes it.
- `"fits"`: the fit() calls that opened a backup directory, each with its
  `History` once it ended; a two-phase script's fits are told apart by
  number, and a later fit's backup gives a rerun's earlier ones their History.
- `"executions"`: the Keras Tuner executions begun for a trial's directory.
- `"written"`: the big files this process wrote in a directory, which a
  later save there (the next fit() too) writes over instead of anew.
- `"removal"`: a directory being removed in the background, with the
  thread removing it: the removal outlives the fit() that began it.

A forked child (a `PyDataset` worker) holds nothing of its parent's: the
modules that keep descriptors close their copies and `forget()` them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

KINDS = frozenset(
    ["lock", "lease", "scratch", "writer", "fits", "executions", "written", "removal"]
)


class _Table:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Any] = {}
        self.guard = threading.RLock()

    def renew_guard_in_child(self) -> None:
        # A thread of the parent may have held the guard at the fork; the
        # child has no such thread, so it starts with a free one.
        self.guard = threading.RLock()


# The one table of what outlives a fit(), by (kind, path): see above.
_held = _Table()


def _key(kind: str, path: str) -> tuple[str, str]:
    if kind not in KINDS:
        raise ValueError(f"Unknown kind {kind!r}: expected one of {sorted(KINDS)}")
    return kind, path


def get(kind: str, path: str) -> Any:
    """What this process holds of `kind` for `path`, or `None`."""
    with _held.guard:
        return _held.entries.get(_key(kind, path))


def put(kind: str, path: str, value: Any) -> None:
    with _held.guard:
        _held.entries[_key(kind, path)] = value


def setdefault(kind: str, path: str, make: Callable[[], Any]) -> Any:
    """What is held of `kind` for `path`, made by `make()` if nothing is."""
    with _held.guard:
        key = _key(kind, path)
        if key not in _held.entries:
            _held.entries[key] = make()
        return _held.entries[key]


def pop(kind: str, path: str, value: Any = None) -> Any:
    """Lets go of `kind` for `path` (only if it is `value`, when given), and
    returns what was held, or `None`."""
    with _held.guard:
        key = _key(kind, path)
        if value is not None and _held.entries.get(key) is not value:
            return None
        return _held.entries.pop(key, None)


def of_kind(kind: str) -> dict[str, Any]:
    """What is held of `kind`, by path (a copy)."""
    _key(kind, "")
    with _held.guard:
        return {p: value for (k, p), value in _held.entries.items() if k == kind}


def forget(kind: str) -> dict[str, Any]:
    """In a forked child: drops every entry of `kind` (the parent's, which
    the child must not hold or remove) and returns them."""
    with _held.guard:  # Reentrant: `of_kind()` takes it too.
        found = of_kind(kind)
        for path in found:
            del _held.entries[kind, path]
    return found


if hasattr(os, "register_at_fork"):
    # Registered when this module is imported, before the modules using it
    # register theirs: their handlers find the guard free.
    os.register_at_fork(after_in_child=_held.renew_guard_in_child)
