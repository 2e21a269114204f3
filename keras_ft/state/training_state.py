"""What a training state is: variables, counters and random state.

`TrainingState` turns a compiled Keras model into a `Snapshot` (the files and
metadata of one checkpoint) and applies one back. A state holds the model's
and optimizer's variables (Keras' own `.weights.h5`), the epoch, batch and
step counters, the states of the model's seed generators (Dropout, noise and
augmentation layers) and of its stateful RNN layers, its metric variables (so
a resumed epoch reports the same mean loss), the global random generators
(`rng.py`), and whatever extra JSON/array tree the caller adds (other
callbacks' states). It does not choose where a checkpoint lives:
`CheckpointStore` hands it a directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_ft import compat, events, threads
from keras_ft.backend import cross_process
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.files import ReadProgress
from keras_ft.checkpoint.store import METADATA_FILE
from keras_ft.distribute import sharded

# Raised here; `keras_ft.state` names them too.
from keras_ft.errors import (
    ConfigurationChangedError,
    CorruptCheckpointError,
)
from keras_ft.state import (
    arrays,
    checks,
    configuration,
    contents,
    rng,
    saved_state,
    weights_load,
)
from keras_ft.state.weights_copy import CapturedWeights, CopyBuffer
from keras_ft.state.weights_layout import WEIGHTS_FILE, WeightsLayout, saved_variables

_MAX_METADATA_BYTES = 64 * 1024 * 1024


def progress_text(epochs_completed: int, batches_completed: int) -> str:
    """Where a save was taken, as `BackupAndRestore` says it: "epoch 2"
    (its end) or "epoch 3, batch 10" (one-based epochs)."""
    if batches_completed:
        return f"epoch {epochs_completed + 1}, batch {batches_completed}"
    return f"epoch {epochs_completed}"


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where training continues after a restore.

    Attributes:
        epoch: Zero-based index of the first epoch to run.
        batch: Batches of that epoch already trained before the backup.
        step: Optimizer steps (`optimizer.iterations`) already taken.
        checkpoint: Path of the checkpoint restored.
        saved_at: When that checkpoint was written (seconds since the epoch).
        extra: The rest of the saved state: random generator states at save
            time (`"rng"`) and at the start of the epoch (`"epoch_begin_rng"`),
            metric values (`"metrics"`), the last batch's logs (`"logs"`), and
            other callbacks' states (`"callbacks"`).
        config_changes: How the model's, optimizer's or loss's configuration
            differs from the one the backup was written with (see
            `keras_ft.state.configuration`); empty when it is the same.
        later_fit: Set when the backup was written by a later `fit()` of
            the script than this one (`TrainingState.fit_number`): its
            number; nothing was loaded, and this fit() has nothing to train.
    """

    epoch: int
    batch: int
    step: int
    checkpoint: str
    saved_at: float
    extra: dict = dataclasses.field(default_factory=dict, repr=False)
    config_changes: list[str] = dataclasses.field(default_factory=list)
    later_fit: int | None = None


@dataclasses.dataclass
class ReadAhead:
    """What `TrainingState.read_ahead()` read of a checkpoint: its weights
    (when they could be read ahead) and the rest of its state, checked."""

    weights: weights_load.ReadWeights | list | None
    extra: dict


@dataclasses.dataclass
class Snapshot:
    """One checkpoint's worth of state in host memory, ready to be written.

    Taking it is the only part of a save that must run in the training
    thread; `keras_ft.saves.save.write_snapshot()` writes it, in
    another thread if the snapshot is a copy.
    """

    weights: CapturedWeights | None
    metadata: dict
    arrays: dict[str, np.ndarray]
    # A sharded save's: this process's pieces (then `weights` is `None`).
    share: sharded.Share | None = None

    def release(self) -> None:
        """Frees the weights' buffer for the next copy; the write is over."""
        if self.weights is not None:
            self.weights.release()
        self.share = None


class TrainingState:
    """Collects and applies the state of a compiled Keras model.

    Args:
        model: The `keras.Model` being trained.
    """

    def __init__(self, model: keras.Model):
        self.model = model
        # The helper threads of its copies and of its saves' writes, closed
        # by the training's writer once its writes are over.
        self.pools = threads.Pools()
        self._weights = WeightsLayout(model, self.pools)
        self._share: sharded.Share | None = None  # The last sharded copy.
        # Whether a sharded copy takes every piece this process holds, not
        # only those it writes into a shared save (for a save of its own).
        self.every_replica = False
        self._configuration: dict | None = None
        # More checks of a checkpoint's `extra` before anything is restored
        # (what the caller saved there): raises ValueError or TypeError.
        self.check_extra: Callable[[dict], None] | None = None
        # Which fit() of the process this is, for a backup dir that several
        # fit() calls share (`BackupAndRestore`); `None`: not counted.
        self.fit_number: int | None = None

    def snapshot(
        self,
        epochs_completed: int,
        batches_completed: int,
        extra: dict[str, Any] | None = None,
        copy: bool = True,
        fill: bool = True,
        check_later: bool = False,
        on_device: bool = False,
        device_failed: Callable[[BaseException], bool] | None = None,
    ) -> Snapshot:
        """The state now, with `extra` (JSON values and NumPy arrays) added.

        Args:
            epochs_completed: Epochs trained so far.
            batches_completed: Batches of the current epoch trained so far.
            extra: More state to save. Defaults to `None`.
            copy: If `True`, the snapshot is a copy that stays valid while
                training goes on; the next `snapshot(copy=True)` reuses its
                buffer as its write frees it. If `False`, it views the
                variables and must be written before the next training step.
                Defaults to `True`.
            fill: With `copy`, whether to copy the weights now; if `False`,
                call `snapshot.weights.fill()` before the next training step
                (a writer may start on it first and follow the copy).
                Defaults to `True`.
            check_later: With `copy`, whether the weights' NaN/infinity
                check follows the copy in the background rather than being
                part of it (see `WeightsLayout.capture()`). Defaults to
                `False`.
            on_device: With `copy` and not `fill`, whether the weights are
                copied on their device now, and `fill()` (in any thread)
                moves that copy to host memory (see `WeightsLayout.capture()`).
                In a sharded save, whether this process's share is left to
                the caller to take (`share()`, from a copy on the device).
                Defaults to `False`.
            device_failed: With `on_device`, told the error of a copy on the
                device that failed; if it returns `True`, the weights are
                copied to host memory instead (the rest of the state is not
                read again: such a read may be a collective that every
                process enters once). Defaults to `None`: the error is raised.
        """
        tree = {
            "seed_generators": [
                keras.ops.convert_to_numpy(v) for v in _seed_states(self.model)
            ],
            "rnn_states": [
                keras.ops.convert_to_numpy(v) for v in _rnn_states(self.model)
            ],
            "metrics": [
                keras.ops.convert_to_numpy(v) for v in self.model.metrics_variables
            ],
            "rng": rng.capture(),
            **(extra or {}),
        }
        metadata = self.metadata(epochs_completed, batches_completed)
        metadata["state"], state_arrays = arrays.split(tree)
        if self.sharded():
            # Each process copies its share; no weights file is written.
            share = None if on_device else self.share()
            return Snapshot(None, metadata, state_arrays, share)
        try:
            captured = self._weights.capture(
                copy=copy, fill=fill, check_later=check_later, on_device=on_device
            )
        except Exception as e:
            if not (on_device and device_failed is not None and device_failed(e)):
                raise
            captured = self._weights.capture(
                copy=copy, fill=fill, check_later=check_later, on_device=False
            )
        return Snapshot(captured, metadata, state_arrays)

    def share(self, values: list | None = None) -> sharded.Share:
        """This process's pieces of a sharded save (see `sharded()`), copied
        to host memory from the variables, or moved there from `values` (a
        copy of `saved_variables()` on their devices, which it empties).

        The copy reuses the previous one's memory: call it only once that
        was written out.
        """
        if values is None:
            taken = sharded.take_share(
                self.saved_variables(), self._share, self.every_replica
            )
        else:
            taken = sharded.move_share(values, self._share, self.every_replica)
        self._share = taken
        return taken

    def sharded(self) -> bool:
        """Whether a save must be sharded: a variable is split across processes
        (JAX, `keras.distribution.ModelParallel`), so no process can write it
        whole; each process then writes the pieces it holds."""
        return sharded.is_sharded(self.saved_variables())

    def saved_variables(self) -> list:
        """The model's and optimizer's variables, in `variable_specs()` order."""
        return saved_variables(self.model)

    def layouts(self) -> list[str]:
        """How each saved variable is laid out across devices, as text."""
        return [cross_process.sharding_text(v) for v in self.saved_variables()]

    def prepare(self, copy: bool = True, reuse: CopyBuffer | None = None) -> None:
        """Walks the model now rather than at the first snapshot; with `copy`,
        also allocates the memory that copied snapshots reuse, unless `reuse`
        (the last fit()'s copy buffer) holds the same file."""
        if not self.sharded():  # A sharded save has no weights file to lay out.
            self._weights.reuse(reuse)
            self._weights.prepare(copy=copy)

    @property
    def copy_buffer(self) -> CopyBuffer | None:
        """The buffer copied snapshots go into, if one was made."""
        return None if self.sharded() else self._weights.copy_buffer

    def metadata(self, epochs_completed: int, batches_completed: int) -> dict:
        """The JSON metadata of a save taken now, without the state tree."""
        return {
            "state_format": contents.STATE_FORMAT_VERSION,
            "epochs_completed": int(epochs_completed),
            "batches_completed": int(batches_completed),
            "step": optimizer_step(self.model),
            "saved_at": time.time(),
            "keras_version": keras.__version__,
            "backend": keras.backend.backend(),
            "build_config": _jsonable(self.model.get_build_config()),
            "configuration": self.configuration(),
            "variables": self.variable_specs(),
            "optimizers": _optimizer_positions(self.model),
        }

    def configuration(self) -> dict:
        """The model's, optimizer's and loss's configuration, described once:
        as the training was set up, before a restore or a callback (one
        that lowers the learning rate, say) changed a variable."""
        if self._configuration is None:
            self._configuration = configuration.describe(self.model)
        return self._configuration

    def read_checkpoint(self, checkpoint: Any, progress: ReadProgress) -> ReadAhead:
        """`read_ahead()` of a `Checkpoint` being verified: what a restore
        hands `CheckpointStore.latest_good_read()`."""
        return self.read_ahead(checkpoint.path, progress, checkpoint.ranges)

    def read_ahead(
        self,
        directory: str,
        progress: ReadProgress | None = None,
        ranges: Callable[[str, int, int], bytes] | None = None,
    ) -> ReadAhead:
        """Reads a checkpoint for `apply()`, without loading anything.

        Safe on a checkpoint not yet verified: nothing is changed. What a
        backup holds is untrusted: its metadata and arrays are read and
        checked here, so that a malformed checkpoint is reported as damaged
        (`CorruptCheckpointError`, and a restore falls back to the one
        before) before the model is touched. The weights are read too when
        the model is built and the file is one this model's layout wrote;
        else `apply()` reads them itself. With `progress` (of the
        checkpoint's verification), reads only what it has read. `ranges`:
        the local copy's `Checkpoint.ranges`, for files left in a bucket.
        """
        if progress is not None:
            # A bucket's files may still be arriving: each is read once its
            # checksum (which waits for its bytes) has read it.
            for name in (METADATA_FILE, arrays.ARRAYS_FILE):
                _wait_for_whole(directory, name, progress)
        metadata = _read_metadata(directory)
        extra = self._read_extra(directory, metadata)
        if self._later_fit(extra) is not None:
            return ReadAhead(None, extra)  # Nothing of it is loaded.
        checks.check_build_config(self.model, directory, metadata)
        weights = self._read_weights(directory, progress, ranges)
        if weights is None:  # Not this model's layout: checked before parsing.
            self._check_weights_file(directory, progress)
        return ReadAhead(weights, extra)

    def _read_weights(
        self,
        directory: str,
        progress: ReadProgress | None,
        ranges: Callable[[str, int, int], bytes] | None,
    ) -> weights_load.ReadWeights | list | None:
        if not self.model.built:
            return None
        if sharded.is_sharded_checkpoint(directory):
            self._ensure_optimizer_built()
            return sharded.read_variables(
                directory, self.saved_variables(), self.variable_specs(), ranges
            )
        if self.sharded():
            return None  # Whole arrays into a split model: see `apply()`.
        return weights_load.read(
            self.model,
            os.path.join(directory, WEIGHTS_FILE),
            self._weights,
            None
            if progress is None
            else functools.partial(progress.wait_for, WEIGHTS_FILE),
        )

    def apply(
        self,
        directory: str,
        metadata: dict,
        read: ReadAhead | None = None,
        *,
        variables_only: bool = False,
        refuse_config_changes: bool = False,
        ranges: Callable[[str, int, int], bytes] | None = None,
    ) -> ResumePoint:
        """Loads a checkpoint's variables into the model.

        Builds the model and optimizer first if `fit()` has not yet done so,
        and checks that every variable's shape matches before loading any.
        `read` is what `read_ahead()` read of it, if it was called.
        With `variables_only`, only the model's and optimizer's variables
        are loaded (a rollback, an evaluation): not the metrics, the seed
        generators or the global random generators. With
        `refuse_config_changes`, a backup written with another configuration
        is refused before anything is loaded.

        Raises:
            keras_ft.CorruptCheckpointError: if what it holds is malformed.
            ValueError: if the checkpoint's variables do not fit the model.
            keras_ft.ConfigurationChangedError: with `refuse_config_changes`,
                if the configuration differs.
        """
        if read is None:  # Checked before anything is loaded.
            read = ReadAhead(None, self._read_extra(directory, metadata))
            if self._later_fit(read.extra) is None:
                checks.check_build_config(self.model, directory, metadata)
                self._check_weights_file(directory)
        later = self._later_fit(read.extra)
        if later is not None:
            return _resume_point(directory, metadata, read.extra, later_fit=later)
        values = read.weights
        changes = configuration.differences(
            metadata.get("configuration"), self.configuration()
        )
        if changes and refuse_config_changes:
            raise ConfigurationChangedError(directory, changes)
        self._ensure_built(metadata)
        try:
            checks.check_variables(
                self.model, self.variable_specs(), metadata["variables"], directory
            )
        except ValueError as e:
            if not changes:
                raise
            # Said as what it is: another configuration's backup.
            unfit = str(e).split(": ", 1)[-1].split(". ", 1)[0]
            raise ConfigurationChangedError(directory, changes, unfit) from None
        if sharded.is_sharded_checkpoint(directory):
            if not isinstance(values, list):
                values = sharded.read_variables(
                    directory, self.saved_variables(), self.variable_specs(), ranges
                )
            for variable, value in zip(self.saved_variables(), values, strict=True):
                variable.assign(value)
        elif self.sharded():
            # Whole arrays (saved by one process) into a model split across
            # processes: Keras' own loader assigns each array, and each
            # process keeps its slices of it.
            weights_load.load_with_keras(
                self.model, os.path.join(directory, WEIGHTS_FILE)
            )
        else:
            weights_load.load(
                self.model,
                os.path.join(directory, WEIGHTS_FILE),
                self._weights,
                values,
            )
        extra = read.extra
        if not variables_only:
            self._apply_seed_generators(extra.get("seed_generators", []))
            self._apply_rnn_states(extra.get("rnn_states", []))
            self.apply_metrics(extra.get("metrics", []))
            rng.apply(extra.get("rng", {}))
        return _resume_point(directory, metadata, extra, config_changes=changes)

    def apply_metrics(self, values: list) -> bool:
        """Sets the model's metric variables, e.g. after `fit()` reset them.

        Returns:
            Whether they were set: `False` if the model has another number of
            metric variables (on TensorFlow, compiled metrics are built in
            the first training step).
        """
        return _assign(self.model.metrics_variables, values)

    def _read_extra(self, directory: str, metadata: Any) -> dict:
        """The state beside the variables (`ResumePoint.extra`), checked
        whole before any of it is set: a malformed one is damage."""
        extra = _extra(directory, metadata)
        try:
            saved_state.check(extra)
            _check_values(extra.get("seed_generators", []), _seed_states(self.model))
            # Their shapes are checked where they are set: another batch
            # size gives them others, and makes the backup no less sound.
            _check_values(extra.get("rnn_states", []), [])
            _check_values(extra.get("metrics", []), self.model.metrics_variables)
            rng.check(extra.get("rng", {}))
            # A later fit()'s callbacks and state are not this one's.
            if self.check_extra is not None and self._later_fit(extra) is None:
                self.check_extra(extra)
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                directory, f"its saved state is malformed: {e}"
            ) from None
        return extra

    def _later_fit(self, extra: dict) -> int | None:
        """The number of the later fit() that wrote `extra`, if it was not
        this one or an earlier one."""
        saved = extra.get("fit")
        if self.fit_number is None or not isinstance(saved, int):
            return None
        return saved if saved > self.fit_number else None

    def _apply_seed_generators(self, values: list) -> None:
        states = _seed_states(self.model)
        if len(values) != len(states):
            events.warn(
                "restore",
                f"BackupAndRestore: the backup holds {len(values)} random seed "
                f"generator states, the model has {len(states)}; random "
                "layers will not continue the saved random stream.",
                stacklevel=2,
            )
            return
        for state, value in zip(states, values, strict=True):
            state.assign(value)

    def _apply_rnn_states(self, values: list) -> None:
        if not set_rnn_states(self.model, values):
            events.warn(
                "restore",
                "BackupAndRestore: the states of the stateful RNN layers in "
                f"the backup ({_shapes(values)}) do not fit the model's "
                f"({_shapes(_rnn_states(self.model))}); they start from zeros, "
                "not from where the backed-up training left them.",
                stacklevel=2,
            )

    def variable_specs(self) -> list[list]:
        """`[group, path, shape, dtype]` of every saved variable, in save order."""
        in_model = len(self.model.weights)
        return [
            [
                "model" if i < in_model else "optimizer",
                v.path,
                list(v.shape),
                str(v.dtype),
            ]
            for i, v in enumerate(self.saved_variables())
        ]

    def _check_weights_file(
        self, directory: str, progress: ReadProgress | None = None
    ) -> None:
        """`weights_load.check()` of a checkpoint's weights file, once the
        checkpoint's verification has read all of it."""
        path = os.path.join(directory, WEIGHTS_FILE)
        if sharded.is_sharded_checkpoint(directory) or not os.path.exists(path):
            return
        if progress is not None:
            progress.wait_for(WEIGHTS_FILE, os.path.getsize(path))
        # A model split across processes has no layout of its own to compare.
        known = self.model.built and not self.sharded()
        weights_load.check(path, self._weights if known else None)

    def _ensure_built(self, metadata: dict) -> None:
        model = self.model
        if not model.built and metadata.get("build_config"):
            # On TensorFlow without a distribution strategy, fit() builds the
            # model inside the first training step; build it now from the
            # input shape recorded at save time, so the backup is restored
            # before any step runs.
            config = metadata["build_config"]
            model.build_from_config(config)
            if not model.built and model.weights and "input_shape" in config:
                # A subclassed model without a `build()` of its own: Keras
                # built its layers by tracing `call()`, and leaves the rest
                # to its first call, which ends with this `build()`.
                model.build(config["input_shape"])
        # A model that trains through `train_step()` alone (a GAN) is never
        # built, but its layers are.
        if not model.built and not model.weights:
            raise ValueError(
                f"Model {model.name!r} is not built, and the backup does not say "
                "how to build it. Build the model before calling `fit()`, e.g. "
                "by calling it on a batch of data."
            )
        # Not the compiled optimizer of a model whose `train_step()` steps
        # others (a GAN compiled with the default, which it never builds).
        if any(kind == "optimizer" for kind, *_ in metadata.get("variables", [])):
            self._ensure_optimizer_built()
        _build_optimizers(self.model, metadata.get("optimizers"))

    def _ensure_optimizer_built(self) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            _build_optimizer(optimizer, self.model.trainable_variables)


def _other_optimizers(model: keras.Model) -> dict[str, keras.optimizers.Optimizer]:
    """The optimizers a model keeps in attributes of its own (a GAN's
    `d_optimizer`), which Keras saves with its weights; not `optimizer`."""
    return {
        name: value
        for name, value in vars(model).items()
        if isinstance(value, keras.optimizers.Optimizer)
        and value is not getattr(model, "optimizer", None)
    }


def _optimizer_positions(model: keras.Model) -> dict[str, list[int]]:
    """For each of `_other_optimizers()` that is built, the positions in the
    model's trainable variables of those it steps (not their paths: a model
    made again in the same process has other layer names): what a restore
    builds it with before loading it."""
    others = _other_optimizers(model)
    if not others:  # Most models: no walk of the variables at each save.
        return {}
    positions = {id(v): i for i, v in enumerate(model.trainable_variables)}
    found = {}
    for name, optimizer in others.items():
        stepped = compat.optimizer_var_list(optimizer) if optimizer.built else None
        if stepped is not None and all(id(v) in positions for v in stepped):
            found[name] = [positions[id(v)] for v in stepped]
    return found


def _build_optimizers(model: keras.Model, saved: Any) -> None:
    """Builds the optimizers in `model`'s attributes that a backup holds
    built (`saved`: `_optimizer_positions()` at the save), on the variables at
    the same positions; one that does not fit is left for the weights
    file's check to name."""
    if not isinstance(saved, dict):
        return
    trainable = model.trainable_variables
    for name, optimizer in _other_optimizers(model).items():
        at = saved.get(name)
        if optimizer.built or not isinstance(at, list) or not at:
            continue
        if all(type(i) is int and 0 <= i < len(trainable) for i in at):
            _build_optimizer(optimizer, [trainable[i] for i in at])


def _build_optimizer(optimizer: keras.optimizers.Optimizer, variables: list) -> None:
    # In the optimizer's name scope, as its first `apply()` builds it where
    # fit() has not (TensorFlow without a strategy): a wrapper's inner
    # optimizer (LossScaleOptimizer's) gets the paths fit() gives.
    with keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(variables)


def optimizer_step(model: keras.Model) -> int:
    """The optimizer's `iterations`, as now (on JAX, read through a sync)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return 0
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _seed_states(model: keras.Model) -> list:
    """The state variables of the seed generators the model's layers own.

    `model.variables` holds them besides the weights and metric variables,
    in a stable order (public API: no walk of private attributes).
    """
    others = {id(v) for v in model.weights} | {id(v) for v in model.metrics_variables}
    found, seen = [], set()
    for variable in model.variables:
        if id(variable) not in others and id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


def set_rnn_states(model: keras.Model, values: list) -> bool:
    """Sets the states of the model's stateful RNN layers to saved `values`
    (again where a resumed epoch's first batch trains: a callback may have
    reset them in `on_epoch_begin`). Returns whether they fit the model."""
    return _assign(_rnn_states(model), values)


def _assign(variables: list, values: list) -> bool:
    """Sets each variable to its value, if they fit one another in number
    and shapes; returns whether they did (nothing is set otherwise)."""
    if len(values) != len(variables) or _misfits(values, variables):
        return False
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)
    return True


def _rnn_states(model: keras.Model) -> list:
    """The carried states of the model's stateful RNN layers (`stateful=True`).

    Keras keeps them out of `model.variables`, and saves them nowhere, yet
    each batch starts from the last one's: without them a resumed training
    starts from zeros where the uninterrupted one went on. Found through the
    public `layers`, `layer`, `forward_layer` and `backward_layer` attributes
    (nested models, `TimeDistributed`, `Bidirectional`).
    """
    found, seen = [], set()
    pending = [model]
    while pending:
        layer = pending.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if isinstance(layer, keras.layers.RNN) and layer.stateful and layer.states:
            found.extend(keras.tree.flatten(layer.states))
        pending.extend(getattr(layer, "layers", None) or ())
        for name in ("layer", "forward_layer", "backward_layer"):
            child = getattr(layer, name, None)
            if isinstance(child, keras.layers.Layer):
                pending.append(child)
    return found


def _shapes(values: list) -> str:
    return ", ".join(str(tuple(v.shape)) for v in values) or "none"


def _check_values(values: Any, variables: list) -> None:
    """Raises `ValueError` unless `values` is a list of arrays (numbers:
    `arrays.read()` refuses others), of
    the variables' shapes where there are as many (a count that differs is
    said where they are set: TensorFlow builds compiled metrics late)."""
    if not isinstance(values, list) or not all(_is_array(v) for v in values):
        raise ValueError("variable values are not a list of arrays")
    if len(values) == len(variables) and _misfits(values, variables):
        raise ValueError("variable values do not have the model's shapes")


def _is_array(value: Any) -> bool:
    # An HDF5 scalar dataset reads back as a NumPy scalar.
    return isinstance(value, (np.ndarray, np.generic))


def _misfits(values: list, variables: list) -> bool:
    return any(
        np.shape(v) != tuple(w.shape) for v, w in zip(values, variables, strict=True)
    )


def _extra(directory: str, metadata: Any) -> dict:
    """The state beside the variables (`ResumePoint.extra`), checked."""
    contents.check_metadata(metadata, directory)
    path = os.path.join(directory, arrays.ARRAYS_FILE)
    try:
        with os.fdopen(
            file_io.open_regular(path, depth=file_io.CHECKPOINT_FILE), "rb"
        ) as f:
            state = arrays.read(f, path)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            directory, f"{arrays.ARRAYS_FILE} cannot be read ({e})"
        ) from None
    try:
        return arrays.join(metadata.get("state", {}), state)
    except ValueError as e:
        raise CorruptCheckpointError(directory, str(e)) from None


def _wait_for_whole(directory: str, name: str, progress: ReadProgress) -> None:
    try:
        size = os.lstat(os.path.join(directory, name)).st_size
    except OSError:
        return  # Missing: reading it says so.
    progress.wait_for(name, size)


def _read_metadata(directory: str) -> dict:
    """A checkpoint's metadata, as the store verified it, or damaged."""
    path = os.path.join(directory, METADATA_FILE)
    try:
        data = file_io.read_regular(
            path, _MAX_METADATA_BYTES, depth=file_io.CHECKPOINT_FILE
        )
        metadata = json.loads(data)
    except (OSError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            directory, f"{METADATA_FILE} cannot be read ({e})"
        ) from None
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(directory, f"{METADATA_FILE} is not an object")
    return metadata


def _jsonable(value: Any) -> Any:
    """Build configs hold tuples and NumPy ints; JSON wants lists and ints."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _resume_point(
    directory: str, metadata: dict, extra: dict, **more: Any
) -> ResumePoint:
    """Where a checkpoint's metadata says training resumes."""
    return ResumePoint(
        epoch=metadata["epochs_completed"],
        batch=metadata["batches_completed"],
        step=metadata["step"],
        checkpoint=directory,
        saved_at=metadata["saved_at"],
        extra=extra,
        **more,
    )
