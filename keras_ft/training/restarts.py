"""Restarts that make no progress: a job its launcher restarts again and
again, each time from the same backup, is failing before its first save.

The chief records, beside the checkpoints, at which step each restart of
the launcher (torchrun's `TORCHELASTIC_RESTART_COUNT`, SLURM's
`SLURM_RESTART_COUNT`) resumed; a restart that resumes where the one before
it did says so, instead of looping silently.
"""

from __future__ import annotations

import json
from typing import Any

from keras_ft import events

NOTICE = "restarts.json"


def check_progress(store: Any, restart: int, step: int) -> str | None:
    """Compares this restart's resume step with the previous restart's, and
    records this one's (on the chief only: it alone writes notices).

    Args:
        store: The chief's checkpoint store (its notices).
        restart: The launcher's restart count (0: the first run).
        step: The optimizer step this run resumed at.

    Returns:
        The warning given, if this restart made no progress.
    """
    said = None
    if restart > 0:
        try:
            data = store.read_notice(NOTICE)
            before = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):
            before = None
        if (
            isinstance(before, dict)
            and isinstance(before.get("restart"), int)
            and before.get("step") == step
            and before["restart"] < restart
        ):
            said = (
                f"keras-ft: restart {restart} resumes at optimizer step {step}, "
                f"as restart {before['restart']} did: the job made no progress "
                "in between. It fails (or is stopped) before its first backup; "
                "look at the previous attempt's log instead of restarting again."
            )
            events.warn("restore", said, stacklevel=2)
    store.remove_notice(NOTICE)
    store.create_notice(NOTICE, json.dumps({"restart": restart, "step": step}).encode())
    return said
