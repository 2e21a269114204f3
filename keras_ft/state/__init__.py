"""What is saved: a training state, its weights file, random state, arrays.

Knows nothing of where a checkpoint lives; `keras_ft.checkpoint` commits the
files a `Snapshot` describes.
"""

from keras_ft.state.training_state import (
    WEIGHTS_FILE,
    ConfigurationChangedError,
    NonFiniteStateError,
    ResumePoint,
    Snapshot,
    TrainingState,
)

__all__ = [
    "WEIGHTS_FILE",
    "ConfigurationChangedError",
    "NonFiniteStateError",
    "ResumePoint",
    "Snapshot",
    "TrainingState",
]
