"""One backup per Keras Tuner trial.

`tuner.search(..., callbacks=[BackupAndRestore(backup_dir)])` runs one
`fit()` per trial (and per execution of a trial) with copies of the same
callbacks. A backup kept by one trial (stopped early, say) must not be
continued by the next trial, which trains other hyperparameters: each
trial's backup lives in `<backup_dir>/trial_<trial id>/`. A search killed
mid-trial and run again with `overwrite=False` gets the same trial back
from the tuner's oracle, and so its backup.

Keras Tuner adds a callback to each trial's `fit()` that carries the trial
(`callback.trial`, with its `trial_id`) and the tuner (`callback.tuner`,
with `executions_per_trial`): those public attributes are what is read.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Iterable
from typing import Any

from keras_ft import holdings
from keras_ft.checkpoint.format import join_location

_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def trial_backup_dir(backup_dir: str, callbacks: Iterable[Any]) -> str:
    """`backup_dir`, or the trial's own directory below it inside a search."""
    found = _tuner_callback(callbacks)
    if found is None:
        return backup_dir
    callback, trial, tuner = found
    trial_id = str(trial.trial_id)
    if not _SAFE_ID.fullmatch(trial_id) or trial_id in (".", ".."):
        trial_id = hashlib.sha1(trial_id.encode()).hexdigest()[:16]
    parts = [f"trial_{trial_id}"]
    if int(getattr(tuner, "executions_per_trial", 1) or 1) > 1:
        number = _execution(join_location(backup_dir, *parts), trial, callback)
        parts.append(f"execution_{number}")
    return join_location(backup_dir, *parts)


def _execution(trial_dir: str, trial: Any, callback: Any) -> int:
    """The trial's n-th `fit()` in this process is its n-th execution, told
    apart by the tuner's callback (one per execution). Held by weak
    references: a search run again (new trial objects of the same ids)
    counts anew, and a callback gone is never mistaken for a new one."""
    seen = holdings.get("executions", trial_dir)
    if seen is None or seen[0]() is not trial:
        seen = [weakref.ref(trial)]
        holdings.put("executions", trial_dir, seen)
    for number, ref in enumerate(seen[1:]):
        if ref() is callback:
            return number
    seen.append(weakref.ref(callback))
    return len(seen) - 2


def _tuner_callback(callbacks: Iterable[Any]) -> tuple[Any, Any, Any] | None:
    for callback in callbacks:
        if not type(callback).__module__.startswith("keras_tuner"):
            continue
        trial = getattr(callback, "trial", None)
        tuner = getattr(callback, "tuner", None)
        if tuner is not None and getattr(trial, "trial_id", None) is not None:
            return callback, trial, tuner
    return None
