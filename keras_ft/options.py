"""Where and how a training's backups are written, checked once.

`BackupAndRestore` builds a `BackupOptions` from its arguments of the same names
when it is made, and hands it whole to the `WorkerTrainingState` of each
`fit()`; a custom loop passes one to `WorkerTrainingState` in place of
`backup_dir` (or the same arguments, which make one).
"""

from __future__ import annotations

import dataclasses
import os

from keras_ft.checkpoint.format import (
    signing_key,
    validate_backup_dir,
    validate_local_dir,
)
from keras_ft.checkpoint.remote import check_storage_options
from keras_ft.state.snapshots import validate_snapshot
from keras_ft.training.policy import KeepLast


@dataclasses.dataclass(frozen=True)
class BackupOptions:
    """A training's backup options (see `keras_ft.WorkerTrainingState`'s
    arguments of the same names), each checked when this is made, with a
    `ValueError` that names the argument, the value and the fix.

    `backup_dir` and `local_dir` become strings; `async_save` a bool.
    """

    backup_dir: str | os.PathLike
    keep: int = 2
    async_save: bool = False
    storage_options: dict | None = None
    verbose: int = 0
    on_config_change: str = "warn"
    manifest_key: str | bytes | None = None
    local_dir: str | os.PathLike | None = None
    snapshot: str = "auto"

    def __post_init__(self) -> None:
        def set_(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        set_("backup_dir", validate_backup_dir(self.backup_dir))
        check_storage_options(self.backup_dir, self.storage_options)
        set_("on_config_change", validate_on_config_change(self.on_config_change))
        signing_key(self.manifest_key)
        set_("local_dir", validate_local_dir(self.local_dir, self.backup_dir))
        KeepLast(self.keep)
        set_("async_save", bool(self.async_save))
        validate_snapshot(self.snapshot)


def validate_on_config_change(value: object) -> str:
    if value not in ("warn", "raise"):
        raise ValueError(
            "Invalid value for argument `on_config_change`. Expected 'warn' or "
            f"'raise'. Received: on_config_change={value!r}"
        )
    return value
