"""Warm start: begin a new training from pretrained weights, never a resumed one.

`tf.train.Supervisor`'s `init_fn`, TensorLayer's `LoadCheckpoint` and
Estimator's `warm_start_from`: weights from a `.weights.h5` or `.keras`
file, or from another keras-ft backup, are loaded when there is no backup
to resume from. Only the model's variables are taken (not an optimizer's
state), matched by their place in Keras' weights file, that is by layer
names; the pretrained file is only read.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from typing import Any

import h5py
import keras
import numpy as np

from keras_ft import compat
from keras_ft.checkpoint.store import CheckpointStore, checkpoints_dir
from keras_ft.state.weights_layout import WEIGHTS_FILE

# Where a `.keras` archive keeps its weights: Keras' archive format.
_KERAS_ARCHIVE_WEIGHTS = "model.weights.h5"


class WarmStart:
    """Where and what to warm-start from.

    Pass it (or just the path) as `keras_ft.BackupAndRestore(warm_start=...)`.
    It is applied at the start of `fit()` only when there is no backup to
    resume from; a resumed run continues from its backup and never applies
    it again.

    Example:

    ```python
    # Fine-tune: take the encoder from a pretrained model, train the head.
    warm = keras_ft.WarmStart("pretrained.keras", layers=r"encoder.*")
    callback = keras_ft.BackupAndRestore("/tmp/backup", warm_start=warm)
    ```

    Args:
        path: A `.weights.h5` file (`model.save_weights()`), a `.keras` file
            (`model.save()`), or the `backup_dir` of another keras-ft
            training (its newest good checkpoint is used).
        layers: Which layers to load: `None` for all, a list of layer names,
            or a regular expression a layer name must match in full. A
            variable is taken if its layer, or a layer it is nested in, is
            selected. Defaults to `None`.
        skip_mismatch: If `False`, a selected layer whose variables are
            missing from the file or have other shapes is an error naming the
            variable and both shapes. If `True`, such a layer is left as it
            is and listed in the message. Defaults to `False`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layers: str | Sequence[str] | None = None,
        skip_mismatch: bool = False,
    ):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(
                "Invalid value for argument `warm_start`. Expected the path of a "
                "`.weights.h5` or `.keras` file or of a keras-ft backup "
                f"directory. Received: warm_start={path!r}"
            )
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ValueError(
                f"Invalid value for argument `warm_start`: {self.path!r} does not "
                "exist. Pass the path of a `.weights.h5` or `.keras` file or of a "
                "keras-ft backup directory."
            )
        self.kind = _kind_of(self.path)
        self.layers = _check_layers(layers)
        self.skip_mismatch = bool(skip_mismatch)

    def __repr__(self) -> str:
        return (
            f"WarmStart({self.path!r}, layers={self.layers!r}, "
            f"skip_mismatch={self.skip_mismatch})"
        )

    def apply(self, model: keras.Model) -> str:
        """Loads the selected weights into `model`; returns what it did.

        Raises:
            ValueError: if a selected variable is missing from the file or
                has another shape (unless `skip_mismatch`), if `layers` names
                a layer the model does not have, or if the model is not
                built.
        """
        if not model.built:
            raise ValueError(
                f"Cannot warm-start model {model.name!r} from {self.path}: it is "
                "not built. Build it before `fit()` (e.g. with a `keras.Input` "
                "or by calling it on a batch)."
            )
        with self._weights_file() as weights:
            if compat.usable("fast_weights"):
                loaded, skipped = self._load_by_groups(model, weights)
            else:
                loaded, skipped = self._load_public(model, weights)
        message = f"warm-started {loaded} variables from {self.path}"
        if skipped:
            message += f"; skipped (skip_mismatch=True): {'; '.join(skipped)}"
        return message

    @contextlib.contextmanager
    def _weights_file(self) -> Iterator[Any]:
        """The weights file to read: a path, or an in-memory file object."""
        if self.kind == "keras":
            with zipfile.ZipFile(self.path) as archive:
                if _KERAS_ARCHIVE_WEIGHTS not in archive.namelist():
                    raise ValueError(
                        f"Cannot warm-start from {self.path}: the archive has no "
                        f"{_KERAS_ARCHIVE_WEIGHTS} (saved with sharded weights, or "
                        "not a Keras file)."
                    )
                yield io.BytesIO(archive.read(_KERAS_ARCHIVE_WEIGHTS))
        elif self.kind == "backup":
            found = CheckpointStore(checkpoints_dir(self.path)).latest_good()
            if found is None:
                raise ValueError(
                    f"Cannot warm-start from {self.path}: the backup directory "
                    "holds no committed checkpoint."
                )
            yield found[0].file(WEIGHTS_FILE)
        else:
            yield self.path

    def _load_by_groups(self, model: keras.Model, weights: Any) -> tuple[int, list]:
        """Through Keras' own walk: each layer's group, each variable named."""
        recorded = compat.record_saveables(model)
        # The file's paths follow class names (`layers/dense_1`); layers are
        # picked by their own names, theirs and those they are nested in.
        layer_at = {
            path: saveable.name
            for path, _, saveable, _ in recorded
            if isinstance(saveable, keras.layers.Layer) and path
        }
        groups = [
            (path, saveable, stored, _names_along(path, layer_at))
            for path, _, saveable, stored in recorded
            if stored and path.split("/")[0] != "optimizer"
        ]
        self._check_selection([names for *_, names in groups])
        loaded, skipped, plan = 0, [], []
        with h5py.File(weights, "r") as f:
            for path, saveable, stored, names in groups:
                if not self._selects(names):
                    continue
                source = f.get(f"{path}/vars" if path else "vars")
                problems = _mismatches(path, stored, source)
                if problems and self.skip_mismatch:
                    skipped.append(f"{path or 'model'}: {', '.join(problems)}")
                    continue
                if problems:
                    raise ValueError(
                        f"Cannot warm-start from {self.path}: "
                        + "; ".join(problems)
                        + ". Pass `keras_ft.WarmStart(path, skip_mismatch=True)` "
                        "to leave such layers as they are, or `layers=` to pick "
                        "the ones that match."
                    )
                plan.append((saveable, {k: np.asarray(source[k]) for k, _ in stored}))
            # Every check passed before anything is loaded.
            for saveable, values in plan:
                saveable.load_own_variables(values)
                loaded += len(values)
        return loaded, skipped

    def _load_public(self, model: keras.Model, weights: Any) -> tuple[int, list]:
        """Through `model.load_weights()`; what is not taken is put back."""
        optimizer = getattr(getattr(model, "optimizer", None), "variables", [])
        taken = [v for v in model.weights if self._selects(v.path.split("/")[:-1])]
        kept = [
            (v, keras.ops.convert_to_numpy(v))
            for v in [*model.weights, *optimizer]
            if not any(v is t for t in taken)
        ]
        with tempfile.TemporaryDirectory(prefix="keras-ft-warm-") as directory:
            if not isinstance(weights, str):
                path = os.path.join(directory, "pretrained.weights.h5")
                with open(path, "wb") as f:
                    f.write(weights.getvalue())
                weights = path
            model.load_weights(weights, skip_mismatch=self.skip_mismatch)
        for variable, value in kept:
            variable.assign(value)
        return len(taken), []

    def _check_selection(self, names: list[list[str]]) -> None:
        every = sorted({n for path in names for n in path})
        if isinstance(self.layers, tuple):
            unknown = [n for n in self.layers if n not in every]
            if unknown:
                raise ValueError(
                    f"Invalid value for argument `layers` of WarmStart: the model "
                    f"has no layer named {', '.join(map(repr, unknown))}. Its "
                    f"layers: {', '.join(every)}."
                )
        if not any(self._selects(path) for path in names):
            raise ValueError(
                f"Invalid value for argument `layers` of WarmStart: {self.layers!r} "
                f"selects none of the model's layers ({', '.join(every)})."
            )

    def _selects(self, names: list[str]) -> bool:
        if self.layers is None:
            return True
        if isinstance(self.layers, tuple):
            return any(n in self.layers for n in names)
        return any(self.layers.fullmatch(n) for n in names)


def _names_along(path: str, layer_at: dict[str, str]) -> list[str]:
    """The names of the layers at `path` and at each path above it."""
    parts = path.split("/")
    prefixes = ("/".join(parts[: i + 1]) for i in range(len(parts)))
    return [layer_at[p] for p in prefixes if p in layer_at]


def _mismatches(path: str, stored: list, source: Any) -> list[str]:
    """What keeps the file's group from loading into these variables."""
    problems = []
    for key, value in stored:
        name = getattr(value, "path", None) or f"{path}/vars/{key}"
        shape = tuple(value.shape)
        if source is None or key not in source:
            problems.append(f"{name} (shape {shape}) is not in the file")
        elif tuple(source[key].shape) != shape:
            problems.append(
                f"{name} has shape {tuple(source[key].shape)} in the file and "
                f"{shape} in the model"
            )
    return problems


def _kind_of(path: str) -> str:
    if os.path.isdir(path):
        if not CheckpointStore(checkpoints_dir(path)).checkpoints():
            raise ValueError(
                f"Invalid value for argument `warm_start`: {path!r} is a directory "
                "but not a keras-ft backup (no committed checkpoint in it). Pass "
                "a `.weights.h5` or `.keras` file, or a backup directory."
            )
        return "backup"
    if zipfile.is_zipfile(path):
        return "keras"
    if h5py.is_hdf5(path):
        return "h5"
    raise ValueError(
        f"Invalid value for argument `warm_start`: {path!r} is neither a Keras "
        "weights file (HDF5) nor a `.keras` archive."
    )


def _check_layers(layers: Any) -> re.Pattern | tuple[str, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, str):
        try:
            return re.compile(layers)
        except re.error as e:
            raise ValueError(
                "Invalid value for argument `layers` of WarmStart: not a valid "
                f"regular expression ({e}). Received: layers={layers!r}"
            ) from None
    if (
        isinstance(layers, Sequence)
        and layers
        and all(isinstance(n, str) for n in layers)
    ):
        return tuple(layers)
    raise ValueError(
        "Invalid value for argument `layers` of WarmStart. Expected `None`, a "
        "non-empty list of layer names or a regular expression. Received: "
        f"layers={layers!r}"
    )


def warm_start_from(value: Any) -> WarmStart | None:
    """`BackupAndRestore(warm_start=...)` as a `WarmStart`, or `None`."""
    if value is None or isinstance(value, WarmStart):
        return value
    return WarmStart(value)
