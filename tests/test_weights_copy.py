"""The copy a save waits for (`keras_ft/state/weights_copy.py`): a copy,
not a view, into a buffer reused by later saves and not held up by page
locking; values not finite found on the way. Written:
`test_weights_layout.py`."""

from __future__ import annotations

import os
import threading

import ml_dtypes
import numpy as np
import pytest
from conftest import make_model
from test_weights_layout import file_bytes, trained_model, write

from keras_ft.state import weights_copy, weights_layout


def test_capture_is_a_copy_not_a_view(data):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    layout = weights_layout.WeightsLayout(model)
    captured = layout.capture()
    before = file_bytes(captured)
    model.fit(*data, epochs=1, verbose=0)  # Changes every variable.
    assert file_bytes(captured) == before
    assert file_bytes(layout.capture()) != before


def test_a_later_layout_of_the_same_file_reuses_the_copy_buffer(data):
    """The next fit()'s state takes the last one's copy buffer (allocated
    and page-locked once) where the file is the same, and only then."""
    model = trained_model(data)
    first = weights_layout.WeightsLayout(model)
    before = file_bytes(first.capture())
    buffer = first.copy_buffer
    model.fit(*data, epochs=1, verbose=0)
    again = weights_layout.WeightsLayout(model)
    again.reuse(buffer)
    assert again.copy_buffer is buffer
    after = file_bytes(again.capture())
    assert after != before
    assert after == file_bytes(weights_layout.capture(model, copy=False))
    other = weights_layout.WeightsLayout(make_model())  # Another file.
    other.reuse(buffer)
    assert other.copy_buffer is None
    assert file_bytes(other.capture()) == file_bytes(
        weights_layout.capture(other.model, copy=False)
    )


def test_a_copy_does_not_wait_for_page_locking(data, monkeypatch):
    """Locking a buffer takes a while: a copy made before it is done goes
    into the buffer unlocked, and the lock lands later."""
    model = trained_model(data)
    layout = weights_layout.WeightsLayout(model)
    write(os.devnull, layout.capture())  # Allocated.
    release = threading.Event()
    locked = []

    def slow_lock(buffer, device):  # The driver's register call, slow.
        assert release.wait(30)
        locked.append(device)
        return lambda: locked.append("unlocked")

    monkeypatch.setattr(weights_copy, "pin_host", slow_lock)
    buffer = layout.copy_buffer
    buffer.pin("accelerator", wait=False)
    assert not buffer.pinned
    want = file_bytes(weights_layout.capture(model, copy=False))
    assert file_bytes(layout.capture()) == want  # Not held up by the lock.
    release.set()
    buffer.pin("accelerator")  # Waits for the lock started.
    assert buffer.pinned and locked == ["accelerator"]
    buffer.release()
    assert locked == ["accelerator", "unlocked"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_non_finite_values_are_found_by_the_copy(dtype):
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    finite = np.full(1000, float(ml_dtypes.finfo(dtype).max) / 10, dtype)
    # The sum overflows (float16 sums in float32); the values are finite.
    assert weights_copy.all_finite(finite)
    for bad in (np.nan, np.inf, -np.inf):
        values = finite.copy()
        values[997] = bad
        assert not weights_copy.all_finite(values)
    assert weights_copy.all_finite(np.arange(10, dtype="int64"))


def test_a_copy_behind_the_last_write_checks_as_it_copies(data):
    """Saves back to back: a copy that must wait for the last write from the
    buffer checks each piece as it copies it (its verdict is known once it
    is made); one that starts with the buffer free leaves the check to a
    thread of its own."""
    model = trained_model(data)
    layout = weights_layout.WeightsLayout(model)
    first = layout.capture(fill=False, check_later=True)
    assert first.checked_later
    first.fill()
    kernel = model.trainable_variables[0]
    value = np.array(kernel.numpy())
    value.flat[0] = np.nan
    kernel.assign(value)
    second = layout.capture(fill=False, check_later=True)  # First unwritten.
    assert not second.checked_later
    first.release()  # Its write is over: the second copy may start.
    second.fill()
    assert second.non_finite  # Found by the copy itself.
    second.release()
    third = layout.capture(fill=False, check_later=True)
    assert third.checked_later
    third.fill()
    third.filled.wait_for(third.filled.total)  # The check's thread is done.
    assert third.non_finite
    third.release()
