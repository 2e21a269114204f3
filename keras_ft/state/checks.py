"""Whether a checkpoint fits the model it is restored into, checked
before anything is loaded: its variables' number, shapes and dtypes, and a
`build_config` that could not build more than the checkpoint holds."""

from __future__ import annotations

import os
import stat

import keras
import ml_dtypes
import numpy as np

from keras_ft import compat, events
from keras_ft.errors import CorruptCheckpointError


def check_build_config(model: keras.Model, directory: str, metadata: dict) -> None:
    """Refuses a `build_config` that would build more than the backup holds.

    An unbuilt model is built from the backup's `build_config` (see
    `TrainingState._ensure_built()`); a forged input shape could make that build
    allocate any amount of memory. A copy of the model is built first
    without allocating: every variable a true build_config makes is in
    the checkpoint's files, so variables larger than those files are
    refused as damage before the real build.
    """
    build_config = metadata.get("build_config")
    if model.built or not build_config:
        return
    try:
        planned = compat.planned_variables(model, build_config)
    except Exception as e:
        raise CorruptCheckpointError(
            directory,
            f"its build_config cannot build model {model.name!r} "
            f"({type(e).__name__}: {e})",
        ) from None
    if planned is None:
        _warn_unchecked_build(model)
        return
    needed = sum(nbytes(shape, dtype) for shape, dtype in planned)
    held = _files_size(directory)
    if needed > held:
        raise CorruptCheckpointError(
            directory,
            f"its build_config would build model {model.name!r} with "
            f"{needed} bytes of variables, but its files hold {held} bytes",
        )


def check_variables(
    model: keras.Model, current: list, saved: list, directory: str
) -> None:
    """Refuses a backup whose variables (`saved`: `[group, path, shape,
    dtype]` of each) differ from the model's (`current`) in number, shape or
    dtype, naming the first that differs."""
    groups = ["model", "optimizer"]
    if getattr(model, "optimizer", None) is None:
        groups.remove("optimizer")  # A model to evaluate: weights only.
    for group in groups:
        have = [s for s in current if s[0] == group]
        want = [s for s in saved if s[0] == group]
        for mine, theirs in zip(have, want, strict=False):
            if list(mine[2]) != list(theirs[2]):
                raise ValueError(
                    f"The backup in {directory} does not match the model: "
                    f"{group} variable {mine[1]!r} has shape "
                    f"{tuple(mine[2])}, but the backup's {theirs[1]!r} has "
                    f"shape {tuple(theirs[2])}. Restore into the same "
                    "architecture, or use another `backup_dir` to start a "
                    "new training."
                )
            if mine[3] != theirs[3]:  # Loaded as is, never cast.
                raise ValueError(
                    f"The backup in {directory} does not match the model: "
                    f"{group} variable {mine[1]!r} is {mine[3]}, but the "
                    f"backup's {theirs[1]!r} is {theirs[3]}. Restore with "
                    "the dtype policy the training was saved with, or use "
                    "another `backup_dir` to start a new training."
                )
        if len(have) != len(want):
            extra = (want if len(want) > len(have) else have)[min(len(have), len(want))]
            raise ValueError(
                f"The backup in {directory} does not match the model: the "
                f"backup has {len(want)} {group} variables, the model has "
                f"{len(have)} (first unmatched: {extra[1]!r} with shape "
                f"{tuple(extra[2])}). Restore into the same architecture and "
                "optimizer, or use another `backup_dir` to start a new "
                "training."
            )


def _files_size(directory: str) -> int:
    """Bytes in the regular files of a checkpoint directory and its subdirectories."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            status = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(status.st_mode):
                total += status.st_size
    return total


def nbytes(shape: tuple, dtype: str) -> int:
    """Bytes of a value of `shape` and `dtype` (a Keras dtype name)."""
    try:
        itemsize = np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize
    except TypeError:
        itemsize = 1  # Unknown to NumPy: the smallest, so never refused for it.
    return int(np.prod(shape, dtype=object)) * itemsize


def _warn_unchecked_build(model: keras.Model) -> None:
    kind = type(model).__name__
    if not events.first_time("unchecked build", kind):
        return
    events.warn(
        "restore",
        f"keras-ft: model {model.name!r} ({kind}) cannot be copied from its "
        "config, so the build_config of a backup is not checked before the "
        "model is built from it. Build the model before `fit()` (call it on a "
        "batch, or give it an `Input`) so that a restore builds nothing.",
        stacklevel=4,
    )
