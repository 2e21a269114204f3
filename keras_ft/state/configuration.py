"""What a training was configured with, to tell another training's backup.

A backup resumes the training that wrote it. A script whose optimizer, loss
or model was changed before it ran again (or another experiment pointed at
the same `backup_dir`) would otherwise continue that state silently. Each
checkpoint records the configuration as `fit()` started (before a restore
changed any variable), and a restore compares it with the model's own.

Names are left out: a model built twice in one process gets its layers
numbered (`dense_1`), which says nothing about what it trains. Only keys
both sides have are compared, so a Keras release that adds an argument to a
config does not count as a change.
"""

from __future__ import annotations

import json
from typing import Any

import keras

from keras_ft import compat

# Keys that name things or wire layers by name, not what is trained.
_WIRING = ("inbound_nodes", "input_layers", "output_layers", "build_config")


def describe(model: keras.Model) -> dict[str, Any]:
    """The model's architecture, optimizer and loss, as JSON values.

    A part that cannot be described (a subclassed model without
    `get_config()`, a loss that is a lambda) is `None` and not compared.
    """
    optimizer = getattr(model, "optimizer", None)
    with compat.tensorflow_left_unimported():  # Else 3 s, on JAX and torch.
        return _describe(model, optimizer)


def _describe(model: keras.Model, optimizer: Any) -> dict[str, Any]:
    return {
        "model": _described(model.get_config),
        "optimizer": None
        if optimizer is None
        else _described(
            lambda: {
                "class": type(optimizer).__name__,
                **{k: v for k, v in optimizer.get_config().items() if k != "name"},
            }
        ),
        "loss": _described(
            lambda: keras.saving.serialize_keras_object(getattr(model, "loss", None))
        ),
    }


def differences(saved: Any, current: dict[str, Any]) -> list[str]:
    """What differs between a backup's configuration and the model's, as
    `"optimizer.learning_rate: 0.001 in the backup, 0.01 now"` lines."""
    if not isinstance(saved, dict):
        return []
    found: list[str] = []
    for part in ("model", "optimizer", "loss"):
        if saved.get(part) is not None and current.get(part) is not None:
            _compare(part, saved[part], current[part], found)
    return found


def _compare(path: str, saved: Any, current: Any, found: list[str]) -> None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in saved:
            if key in current:
                _compare(f"{path}.{key}", saved[key], current[key], found)
    elif isinstance(saved, list) and isinstance(current, list):
        if len(saved) != len(current):
            found.append(
                f"{path}: {len(saved)} entries in the backup, {len(current)} now"
            )
            return
        for i, (a, b) in enumerate(zip(saved, current, strict=True)):
            _compare(f"{path}[{i}]", a, b, found)
    elif saved != current:
        found.append(f"{path}: {_shown(saved)} in the backup, {_shown(current)} now")


def _shown(value: Any) -> str:
    # Rates held in float32 variables read back as 0.009999999776482582.
    return f"{value:.7g}" if isinstance(value, float) else repr(value)


def _described(get: Any) -> Any:
    try:
        config = get()
    except Exception:  # No config to compare: say nothing rather than fail.
        return None
    # Through JSON, as the metadata is: tuples become lists, NumPy numbers
    # Python ones; what JSON cannot hold is named by its type.
    text = json.dumps(config, default=lambda o: _json_value(o))
    return _without_names(json.loads(text))


def _json_value(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return f"<{type(value).__name__}>"


def _without_names(value: Any) -> Any:
    if isinstance(value, list):
        return [_without_names(v) for v in value]
    if not isinstance(value, dict):
        return value
    # A model's own config has `trainable`; a functional model's entry for
    # a layer has `inbound_nodes`; a serialized object has `class_name` and
    # `config`, whose `name` is the object's. A dtype policy's name
    # (`"mixed_float16"`) is kept: it is what the layer computes in.
    named = "trainable" in value or "inbound_nodes" in value
    result = {
        k: _without_names(v)
        for k, v in value.items()
        if k not in _WIRING and not (named and k == "name")
    }
    config = result.get("config")
    if (
        isinstance(config, dict)
        and isinstance(result.get("class_name"), str)
        and not result["class_name"].endswith("DTypePolicy")
    ):
        config.pop("name", None)
    return result
