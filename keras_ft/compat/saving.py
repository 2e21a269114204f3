"""Keras' own walk of a model's saveable objects, for the fast weights path.

`model.save_weights()` walks the model, its layers and its optimizer, and
has each object store its variables into an HDF5 group; `load_weights()`
walks again to hand each object its group. keras-ft runs the same walks
(`saving_lib._save_state` / `_load_state`) with stores of its own: once per
model structure to learn the file's layout, and on restore to hand each
object views of a mapped file. Without these internals, saves go through
`model.save_weights()` and restores through `model.load_weights()`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

from keras_ft.compat.registry import register, usable
from keras_ft.once import made_once

_SAVE_PARAMETERS = ["weights_store", "assets_store", "inner_path", "visited_saveables"]
_LOAD_PARAMETERS = ["visited_saveables", "failed_saveables", "error_msgs"]


@register(
    "fast_weights",
    "saves copy the weights with model.save_weights() in the training thread "
    "(async saves overlap only the commit) and restores read them with "
    "model.load_weights(): slower, same files",
)
def _check_fast_weights() -> bool:
    from keras.src.saving import saving_lib

    save = list(inspect.signature(saving_lib._save_state).parameters)
    load = list(inspect.signature(saving_lib._load_state).parameters)
    return (
        save[:1] == ["saveable"]
        and save[1:] == _SAVE_PARAMETERS
        and load[0] == "saveable"
        and all(name in load for name in ["weights_store", *_LOAD_PARAMETERS])
        and isinstance(saving_lib.H5IOStore, type)
        and callable(saving_lib._raise_loading_failure)
        and callable(saving_lib.get_attr_skipset)
        and hasattr(sys, "_getframe")
    )


Group = tuple[str, "dict | None", Any, list[tuple[str, Any]]]


def record_saveables(model: Any) -> list[Group]:
    """What `model.save_weights()` would store, without writing anything.

    Returns:
        One `(path, attributes, saveable, [(key, value), ...])` per HDF5
        group, in the order Keras writes them; `saveable` is the object
        whose `save_own_variables()` filled the group.
    """
    from keras.src.saving import saving_lib

    recorder = _Recorder()
    with _skipsets_cached():
        saving_lib._save_state(
            model,
            weights_store=recorder,
            assets_store=None,
            inner_path="",
            visited_saveables=set(),
        )
    return recorder.groups


def load_with_keras_walk(
    model: Any,
    groups: dict[str, dict[str, Any]],
    convert: Callable[[Any], Any],
) -> None:
    """Loads `{group path: {key: value}}` into `model` through Keras' walk,
    each value passed through `convert` first, as `load_weights()` would."""
    from keras.src.saving import saving_lib

    errors: dict = {}
    failed: set = set()
    with _skipsets_cached():
        saving_lib._load_state(
            model,
            weights_store=_Views(groups, convert),
            assets_store=None,
            inner_path="",
            visited_saveables=set(),
            failed_saveables=failed,
            error_msgs=errors,
        )
    if failed:
        saving_lib._raise_loading_failure(errors)


def raise_loading_failure(errors: dict[int, tuple[Any, Exception]]) -> None:
    """Raises the error Keras raises when objects failed to load their variables."""
    from keras.src.saving import saving_lib

    saving_lib._raise_loading_failure(errors)


@contextlib.contextmanager
def _skipsets_cached() -> Iterator[None]:
    """Remembers, during our walks, which attributes a walk skips.

    Keras means to cache them, but stores them under another key than the
    one it looks up (Keras 3.15), so every walk builds each set again, and
    for an optimizer that constructs a new optimizer: ~6 ms a walk on
    TensorFlow. The sets depend only on the object type.
    """
    from keras.src.saving import saving_lib

    original = saving_lib.get_attr_skipset
    # Cached for the process: the skip sets depend only on the object type.
    saving_lib.get_attr_skipset = made_once(
        f"keras get_attr_skipset {id(original)}", lambda: functools.cache(original)
    )
    try:
        yield
    finally:
        saving_lib.get_attr_skipset = original


try:  # The store class `_save_state` and `_load_state` accept.
    from keras.src.saving.saving_lib import H5IOStore as _KerasStore
except ImportError:  # Moved: the "fast_weights" check fails; these go unused.
    _KerasStore = object


class _Recorder(_KerasStore):
    """Stands where `save_weights()` puts its HDF5 store, and takes notes.

    `_save_state` accepts only Keras' own store classes, hence the
    subclass; none of its file handling is used.
    """

    def __init__(self) -> None:  # No HDF5 file behind it.
        self.groups: list[Group] = []

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict | None = None) -> _Recorder:
        # The object about to save into this group is `_save_state`'s
        # argument; its `save_own_variables()` is what a capture calls.
        saveable = sys._getframe(1).f_locals.get("saveable")
        if saveable is None:
            raise RuntimeError("_save_state has no local `saveable`")
        self.groups.append((path, dict(metadata) if metadata else None, saveable, []))
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        self.groups[-1][3].append((key, value))

    def close(self) -> None:
        pass


class _Views(_KerasStore):
    """Serves `load_own_variables()` values from a dictionary."""

    def __init__(  # No HDF5 file behind it.
        self,
        groups: dict[str, dict[str, Any]],
        convert: Callable[[Any], Any],
    ):
        self._groups = groups
        self._convert = convert
        self._paths = {
            "/".join(parts[:i])
            for parts in (g.split("/") for g in groups if g)
            for i in range(1, len(parts) + 1)
        }
        self._current: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return True

    def get(self, path: str) -> _Views:
        self._current = self._groups.get(path, {})
        return self

    def has_path(self, path: str) -> bool:
        return path in self._paths

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._current)

    def keys(self):
        return self._current.keys()

    def __getitem__(self, key: str) -> Any:
        return self._convert(self._current[key])

    def __contains__(self, key: object) -> bool:
        return key in self._current


def _not_tensorflow_backend() -> bool:
    import keras

    return keras.backend.backend() != "tensorflow"


@register(
    "config_without_tensorflow",
    "describing a model's configuration for its backup imports TensorFlow, "
    "once per process (seconds) on the JAX and PyTorch backends",
    applies=_not_tensorflow_backend,
)
def _check_config_without_tensorflow() -> bool:
    from keras.src.utils import module_utils

    lazy = module_utils.tensorflow
    # `vars()`: a plain attribute lookup of a missing name imports the module.
    return isinstance(lazy, module_utils.LazyModule) and "_available" in vars(lazy)


@contextlib.contextmanager
def tensorflow_left_unimported() -> Iterator[None]:
    """While TensorFlow is not imported, Keras' serialization (`get_config()`)
    is told it is not there rather than importing it to check whether an
    object is one of its types: none can be, if it was never imported."""
    if "tensorflow" in sys.modules or not _not_tensorflow_backend():
        yield
        return
    if not usable("config_without_tensorflow"):
        yield
        return
    from keras.src.utils import module_utils

    lazy = module_utils.tensorflow
    saved = vars(lazy).get("_available")
    lazy._available = False
    try:
        yield
    finally:
        lazy._available = saved
