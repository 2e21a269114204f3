"""A training's options, checked once.

`BackupAndRestore` builds a `BackupOptions` (where and how backups are
written) and a `FitOptions` (when a `fit()` saves, and what it does around the
saves) from its arguments of the same names when it is made. It hands the
first whole to the `WorkerTrainingState` of each `fit()`; a custom loop passes
one to `WorkerTrainingState` in place of `backup_dir` (or the same arguments,
which make one).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from keras_ft.checkpoint.format import (
    signing_key,
    validate_backup_dir,
    validate_local_dir,
)
from keras_ft.checkpoint.remote import check_storage_options
from keras_ft.state.snapshots import validate_snapshot
from keras_ft.training import policy
from keras_ft.training.listeners import CheckpointListener, check_listeners
from keras_ft.training.policy import KeepLast
from keras_ft.training.preemption import check_grace_period, parse_signals
from keras_ft.training.warm_start import WarmStart, warm_start_from
from keras_ft.training.watchdog import check_stall_timeout


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
        set_("async_save", check_flag("async_save", self.async_save))
        validate_snapshot(self.snapshot)
        set_("verbose", check_verbose(self.verbose))


def validate_on_config_change(value: object) -> str:
    if value not in ("warn", "raise"):
        raise ValueError(
            "Invalid value for argument `on_config_change`. Expected 'warn' or "
            f"'raise'. Received: on_config_change={value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """When `BackupAndRestore` saves in a `fit()` and what it does around
    the saves (its arguments of the same names), each checked when this is
    made, with a `ValueError` that names the argument, the value and the
    fix. `local_dir` is the backup's (`BackupOptions.local_dir`), which
    `local_save_freq` needs.

    `preemption_signals` become `signal.Signals`, `grace_period` and
    `first_batch_timeout` floats, `warm_start` a `WarmStart` (or `None`),
    `listeners` a tuple, and the flags bools.
    """

    save_freq: str | int | bool = "epoch"
    double_checkpoint: bool = False
    delete_checkpoint: bool = True
    overhead_budget: float = 0.02
    save_every_seconds: float | None = None
    on_save_error: str = "raise"
    preemption_signals: tuple | None = ("SIGTERM", "SIGINT")
    grace_period: float = 25.0
    exit_on_preemption: bool = True
    warm_start: str | os.PathLike | WarmStart | None = None
    listeners: Sequence[CheckpointListener] | None = None
    local_dir: str | None = None
    local_save_freq: str | int | None = None
    stall_timeout: float | str | bool | None = None
    first_batch_timeout: float = 1800.0
    goodput_file: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        def set_(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        self.schedules()  # Raises for a `save_freq` or seconds it cannot keep.
        check_on_save_error(self.on_save_error)
        set_("preemption_signals", parse_signals(self.preemption_signals))
        set_("grace_period", check_grace_period(self.grace_period))
        set_("warm_start", warm_start_from(self.warm_start))
        set_("listeners", check_listeners(self.listeners))
        check_stall_timeout(self.stall_timeout, self.first_batch_timeout)
        set_("first_batch_timeout", float(self.first_batch_timeout))
        if self.goodput_file is not None and not isinstance(
            self.goodput_file, (str, os.PathLike)
        ):
            raise ValueError(
                "Invalid value for argument `goodput_file`. Expected a path to a "
                f"file, or None. Received: goodput_file={self.goodput_file!r}"
            )
        for flag in ("double_checkpoint", "delete_checkpoint", "exit_on_preemption"):
            set_(flag, check_flag(flag, getattr(self, flag)))

    def schedules(self) -> tuple[policy.AnyOf, policy.SaveSchedule]:
        """New schedules of the saves (`save_freq`, `save_every_seconds`) and
        of the local tier's own saves (`local_save_freq`)."""
        return (
            policy.schedule_from_arguments(
                self.save_freq, self.overhead_budget, self.save_every_seconds
            ),
            policy.local_schedule(self.local_save_freq, self.local_dir),
        )

    @property
    def backs_up_stopped_epochs(self) -> bool:
        """Whether an epoch another callback cuts short is backed up where it
        stopped: only if saves beyond the preemption ones were asked for."""
        return self.save_freq is not False or self.save_every_seconds is not None


def check_flag(name: str, value: object) -> bool:
    """`value` as a bool, where it is one (or 0 or 1): a string such as
    "False" would otherwise count as true."""
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, (int, np.integer)) and value in (0, 1)
    ):
        return bool(value)
    raise ValueError(
        f"Invalid value for argument `{name}`. Expected True or False. "
        f"Received: {name}={value!r}"
    )


def check_verbose(value: object) -> int:
    if isinstance(value, (bool, np.bool_, int, np.integer)) and value >= 0:
        return int(value)
    raise ValueError(
        "Invalid value for argument `verbose`. Expected 0 (silent) or 1 (a line "
        f"for each restore). Received: verbose={value!r}"
    )


def check_on_save_error(value: object) -> None:
    if value not in ("raise", "warn"):
        raise ValueError(
            "Invalid value for argument `on_save_error`. Expected 'raise' or "
            f"'warn'. Received: on_save_error={value!r}"
        )
