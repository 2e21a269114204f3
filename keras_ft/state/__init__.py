"""What is saved: a training state, its weights file, random state, arrays.

Knows nothing of where a checkpoint lives; `keras_ft.checkpoint` commits the
files a `Snapshot` describes. The names below import Keras when first used,
so that the modules that need no Keras (`contents`, `arrays`, `hdf5`) can be
imported by the command line without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "WEIGHTS_FILE",
    "ResumePoint",
    "Snapshot",
    "TrainingState",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("keras_ft.state.training_state"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
