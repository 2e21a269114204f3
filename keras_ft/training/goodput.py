"""What a run's time went to: the chief records each attempt of a training.

An attempt is one process's `fit()`, from the process's start to its last
batch. The chief writes one small JSON notice per attempt beside the
checkpoints (`goodput_<start>.json`), rewritten whole at most every
`FLUSH_SECONDS` and at the end: a killed attempt leaves what it had recorded
up to two seconds before it died. `keras-ft goodput` (`keras_ft/goodput.py`)
turns the attempts into goodput and badput, in the categories of Google's
ml-goodput-measurement: productive time, startup, restore, checkpointing,
lost work (batches trained again after a failure) and time with no process
running.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

PREFIX = "goodput_"
# A killed attempt's last seconds (up to this many) count as time down.
FLUSH_SECONDS = 2.0
# Samples kept per attempt: past it, every other one goes (the record, which
# is rewritten at each flush, stays small over a run of weeks).
MAX_SAMPLES = 1000
_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started (wall clock); on Linux from `/proc`, else
    when keras-ft was first imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        # Seconds since boot to 10 ms (the boot time in /proc/stat is in
        # whole seconds: a restart within one could seem to start before
        # the attempt it follows ended).
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


class GoodputRecorder:
    """Records one attempt of a training into the chief's store.

    Args:
        store: The chief's `CheckpointStore` (its notices).
        clock: The wall clock; `time.time` but in tests.
    """

    def __init__(self, store: Any, clock: Any = time.time):
        self.store = store
        self.clock = clock
        started = process_start_time()
        self.name = f"{PREFIX}{int(started * 1e6):017d}.json"
        self.record: dict[str, Any] = {
            "process_start": started,
            "train_begin": clock(),
            "restore_begin": None,
            "restore_end": None,
            "resumed_step": 0,
            "samples": [],  # [wall time, optimizer step] at batch ends.
            "save_seconds": 0.0,
            "end": None,
            "status": None,
        }
        self._flushed = 0.0

    def restore_begin(self) -> None:
        self.record["restore_begin"] = self.clock()

    def restore_end(self, step: int) -> None:
        self.record["restore_end"] = self.clock()
        self.record["resumed_step"] = int(step)

    def batch_end(self, step: Callable[[], int], save_seconds: float) -> None:
        """A batch ended; `step()` (the optimizer's, which may sync) is asked
        only when a sample is taken."""
        now = self.clock()
        samples = self.record["samples"]
        if not samples or now - self._flushed >= FLUSH_SECONDS:
            self.record["save_seconds"] = float(save_seconds)
            samples.append([now, int(step())])
            if len(samples) > MAX_SAMPLES:
                samples[1:-1] = samples[2:-1:2]
            self._flush(now)

    def end(self, step: int, save_seconds: float, status: str) -> None:
        now = self.clock()
        self.record["samples"].append([now, int(step)])
        self.record.update(end=now, status=status, save_seconds=float(save_seconds))
        self._flush(now)

    def _flush(self, now: float) -> None:
        self._flushed = now
        # A bucket out of reach: the next flush tries again.
        with contextlib.suppress(OSError):
            self.store.replace_notice(self.name, json.dumps(self.record).encode())


# A finished run's record, where the user names a file for it: the newest
# attempts, their samples thinned, so that it stays small whatever the
# run's length. (Older keras-ft kept it in `backup_dir` as `KEPT`.)
KEPT = "goodput.json"
MAX_KEPT_ATTEMPTS = 100
KEPT_SAMPLES = 200
MAX_KEPT_BYTES = 4 * 1024 * 1024


def thinned(attempts: list[dict[str, Any]]) -> bytes | None:
    """The record of `attempts` to keep, as JSON (`None` if too large)."""
    attempts = [dict(a, samples=list(a["samples"])) for a in attempts]
    attempts = attempts[-MAX_KEPT_ATTEMPTS:]
    for record in attempts:
        samples = record["samples"]
        while len(samples) > KEPT_SAMPLES:
            samples[1:-1] = samples[2:-1:2]
    data = json.dumps({"attempts": attempts}).encode()
    return data if len(data) <= MAX_KEPT_BYTES else None


def kept(root: Any) -> list:
    """The attempts an older keras-ft kept in `root` (a `backup_dir`'s
    storage), unchecked (`[]` if none)."""
    try:
        data = root.notices.read(KEPT, MAX_KEPT_BYTES)
        value = json.loads(data or b"null")
    except (OSError, ValueError, RecursionError):
        return []
    attempts = value.get("attempts") if isinstance(value, dict) else None
    return attempts if isinstance(attempts, list) else []
