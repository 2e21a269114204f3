"""A Python generator as `fit()`'s `validation_data`: where its stream stands.

Keras makes the adapter of such a generator at a `fit()`'s first validation:
it draws two batches to learn their shapes, and every validation yields those
two again, then draws the rest (to `validation_steps`) from the generator,
which goes on from one validation to the next. A rerun's new generator would
start again at its first batch, so its validations, and whatever follows
`val_loss` (`ReduceLROnPlateau`, `EarlyStopping`), would see other batches
than the uninterrupted run's. A backup counts the batches drawn after the
first two; the rerun's first validation draws as many before it yields any,
with the global random generators put back afterwards. A generator that
keeps its own state (reading in order, or from a generator seeded in it)
then validates on the same batches as before. One that draws from NumPy's or
Python's global generators does not: Keras' first two draws come at another
point of them.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_ft import compat, events
from keras_ft.state import ResumePoint, rng


class ValidationStream:
    """The draws from a `fit()`'s validation generator.

    Args:
        drawn_before: The draws a backup counted (`drawn()` at its save);
            the first validation draws them again before it yields any.
        passes_before: How many epochs that backup's training had begun:
            a count past what as many validations could draw is damage.
    """

    def __init__(self, drawn_before: int = 0, passes_before: int = 0):
        self._drawn = drawn_before
        self._skip = drawn_before
        self._passes_before = passes_before
        self._source: Any = None
        self._seen = False  # Whether a validation of this fit() began.
        self._at_begin = drawn_before  # As the last validation began.

    @classmethod
    def resuming(cls, point: ResumePoint | None) -> ValidationStream:
        """The stream of a fit() that resumes `point` (`None`: starts anew;
        a later fit()'s backup: nothing of it is this fit()'s)."""
        if point is None or point.later_fit is not None:
            return cls()
        return cls(point.extra.get("validation_drawn", 0), point.epoch)

    def test_begin(self, model: keras.Model) -> None:
        """Call at each validation's begin (`on_test_begin`)."""
        if not self._seen:
            self._seen = True
            self._attach(model)
        self._at_begin = self._drawn

    def _attach(self, model: keras.Model) -> None:
        found = compat.count_validation_draws(model, self._count)
        skip, self._skip = self._skip, 0
        if found is None:
            return
        self._source, steps = found
        if not skip:
            return
        if steps and skip > (self._passes_before + 1) * steps:
            events.warn(
                "restore",
                f"BackupAndRestore: the backup counts {skip} batches drawn from "
                "the validation generator, more than its validations could "
                "draw: the validation generator starts at its first batch.",
            )
            self._drawn = 0
            return
        state = rng.capture()  # What the rerun's training draws is the same.
        try:
            for _ in range(skip):
                next(self._source)
        except StopIteration:
            pass
        finally:
            rng.apply(state)

    def _count(self) -> None:
        self._drawn += 1

    def drawn(self, in_validation: bool = False) -> int | None:
        """What a save notes: the batches drawn from the validation generator
        after its first two (`in_validation`: before the validation under
        way, which a resume runs again), or `None` if validation reads
        another input."""
        if self._source is None and not self._drawn:
            return None
        return self._at_begin if in_validation else self._drawn
