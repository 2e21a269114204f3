"""PreemptionWatcher: signals become a request to save and stop."""

from __future__ import annotations

import os
import signal

import pytest

from keras_ft.preemption import PreemptionWatcher, parse_signals


def test_parse_signals_accepts_names_and_numbers():
    assert parse_signals(("SIGTERM", 2)) == (signal.SIGTERM, signal.SIGINT)
    assert parse_signals("sigterm") == (signal.SIGTERM,)
    assert parse_signals(None) == ()


@pytest.mark.parametrize("bad", ["SIGNOPE", 12345, ["SIGTERM", "x"]])
def test_parse_signals_rejects_unknown_signals(bad):
    with pytest.raises(ValueError, match="`preemption_signals`.*Received"):
        parse_signals(bad)


def test_signal_is_recorded_chained_and_old_handler_restored():
    calls = []

    def user_handler(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGUSR1, user_handler)
    try:
        watcher = PreemptionWatcher((signal.SIGUSR1,), grace_period=30)
        assert watcher.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.received == signal.SIGUSR1
        assert calls == [signal.SIGUSR1]  # Chained to the earlier handler.
        watcher.done()
        watcher.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is user_handler
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_python_default_sigint_handler_is_not_chained():
    watcher = PreemptionWatcher((signal.SIGINT,), grace_period=30)
    previous = signal.getsignal(signal.SIGINT)
    assert watcher.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # No KeyboardInterrupt here.
        assert watcher.received == signal.SIGINT
    finally:
        watcher.done()
        watcher.uninstall()
    assert signal.getsignal(signal.SIGINT) is previous


def test_install_outside_the_main_thread_warns_and_does_nothing():
    import threading

    results = []
    watcher = PreemptionWatcher((signal.SIGUSR2,), grace_period=30)

    def run():
        with pytest.warns(UserWarning, match="main thread"):
            results.append(watcher.install())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [False]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
