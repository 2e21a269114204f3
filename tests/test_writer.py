"""BackgroundWriter: one write in flight, errors never lost."""

from __future__ import annotations

import threading
import time

import pytest

from keras_ft.writer import BackgroundWriter


def test_writes_run_in_the_background_one_at_a_time():
    writer = BackgroundWriter()
    running, overlaps, order = [], [], []
    lock = threading.Lock()
    gate = threading.Event()
    released = []  # Whether each write saw the gate opened (not a timeout).

    def write(i):
        def run():
            with lock:
                running.append(i)
                overlaps.append(len(running))
            released.append(gate.wait(timeout=30))
            order.append(i)
            with lock:
                running.remove(i)
            return i

        return run

    writer.submit(write(1))
    # submit() returned while write 1 is still held at the gate: had it
    # waited, the write would have timed out and recorded False.
    assert order == []
    gate.set()
    writer.submit(write(2))  # Waits for 1 first.
    assert order[0] == 1
    assert writer.wait() == 2
    assert order == [1, 2] and max(overlaps) == 1 and released == [True, True]


def test_an_error_is_raised_at_the_next_look():
    writer = BackgroundWriter()

    def fail():
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    while not writer._pending.done:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space"):
        writer.raise_if_failed()
    writer.raise_if_failed()  # Raised once, then gone.
    writer.submit(fail)
    with pytest.raises(OSError):
        writer.submit(lambda: None)  # The next save sees it too.
    writer.wait()


def test_raise_if_failed_does_not_wait():
    writer = BackgroundWriter()
    gate = threading.Event()

    def fail_after_gate():
        gate.wait(timeout=30)
        raise OSError(5, "Input/output error")

    writer.submit(fail_after_gate)
    writer.raise_if_failed()  # Returns at once: the write is held at the gate.
    gate.set()
    with pytest.raises(OSError, match="Input/output"):
        writer.wait()
