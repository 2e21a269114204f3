"""Learning what building a model would allocate, without allocating it.

A backup records each model's `build_config`, from which a restore builds a
model that `fit()` has not built yet. A backup is untrusted: a forged input
shape could make that build allocate any amount of memory. A copy of the
model is built first inside a `keras.StatelessScope` that does not
initialize variables, so each variable gets its shape and dtype but no
memory; the copy's pending variables are then dropped from Keras' global
list of variables to initialize (a private name), so that no later scope
allocates them.
"""

from __future__ import annotations

import keras

from keras_ft.compat.registry import fail, register, usable
from keras_ft.compat.saving import tensorflow_left_unimported

_PENDING = "uninitialized_variables"


@register(
    "dry_build",
    "a backup's build_config is not checked against the backup's variables "
    "before an unbuilt model is built from it (a forged one could make the "
    "build allocate any amount of memory)",
)
def _check_dry_build() -> bool:
    from keras.src.backend.common import global_state

    pending = global_state.get_global_attribute(_PENDING, [], set_to_default=True)
    return isinstance(pending, list) and hasattr(keras, "StatelessScope")


def planned_variables(model: keras.Model, build_config: dict) -> list[tuple] | None:
    """`(shape, dtype)` of each of `model.weights` once built from
    `build_config`, learned on a copy of the model without allocating them.

    Returns:
        The list, or `None` where it cannot be learned: the model cannot be
        copied from its config, or the internals moved (warned once).

    Raises:
        Whatever building the copy from `build_config` raises.
    """
    if not usable("dry_build"):
        return None
    try:
        with tensorflow_left_unimported():  # Else 3 s and 0.5 GB, on JAX and torch.
            copy = type(model).from_config(model.get_config())
    except Exception:  # A model without a config: nothing to build a copy of.
        return None
    from keras.src.backend.common import global_state

    before = list(global_state.get_global_attribute(_PENDING, [], set_to_default=True))
    try:
        with keras.StatelessScope(initialize_variables=False):
            copy.build_from_config(build_config)
        return [(tuple(v.shape), str(v.dtype)) for v in copy.weights]
    finally:
        try:
            kept = {id(v) for v in before}
            pending = global_state.get_global_attribute(_PENDING) or []
            global_state.set_global_attribute(
                _PENDING, [v for v in pending if id(v) in kept]
            )
        except Exception as e:  # Moved since the check: stop dry builds.
            fail("dry_build", e)
