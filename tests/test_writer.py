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

    def write(i):
        def run():
            with lock:
                running.append(i)
                overlaps.append(len(running))
            time.sleep(0.05)
            order.append(i)
            with lock:
                running.remove(i)
            return i

        return run

    started = time.monotonic()
    writer.submit(write(1))
    assert time.monotonic() - started < 0.04  # Did not wait for the write.
    writer.submit(write(2))  # Waits for 1 first.
    assert order == [1]
    assert writer.wait() == 2
    assert order == [1, 2] and max(overlaps) == 1


def test_an_error_is_raised_at_the_next_look():
    writer = BackgroundWriter()

    def fail():
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    time.sleep(0.05)
    with pytest.raises(OSError, match="No space"):
        writer.raise_if_failed()
    writer.raise_if_failed()  # Raised once, then gone.
    writer.submit(fail)
    with pytest.raises(OSError):
        writer.submit(lambda: None)  # The next save sees it too.
    writer.wait()


def test_raise_if_failed_does_not_wait():
    writer = BackgroundWriter()
    writer.submit(lambda: time.sleep(0.2))
    started = time.monotonic()
    writer.raise_if_failed()
    assert time.monotonic() - started < 0.1
    writer.wait()
