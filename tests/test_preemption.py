"""PreemptionWatcher: signals become a request to save and stop."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import run_once_on, subprocess_env

from keras_ft.checkpoint.local import LocalStorage
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.training.preemption import ClusterNotice, PreemptionWatcher, parse_signals

# Signals to processes that train nothing: the backend does not matter.
ONCE = run_once_on("torch", "signals and processes")


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
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


def notice_store(where, tmp_path):
    """The store a cluster's notice goes through: a disk or a bucket."""
    if where == "disk":
        return CheckpointStore(str(tmp_path))
    return CheckpointStore(f"memory://notice-{tmp_path.name}/chief")


def names_in(store):
    if isinstance(store.storage, LocalStorage):
        return os.listdir(store.directory)
    bucket = store.storage
    return [path.rsplit("/", 1)[-1] for path in bucket.fs.find(bucket.root)]


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_cluster_notice_first_published_wins(tmp_path, where):
    store = notice_store(where, tmp_path)
    first = ClusterNotice(store, resumed_from=40)
    second = ClusterNotice(store, resumed_from=40)
    assert first.read() is None
    notice = first.publish(7, signal.SIGTERM, worker=1)
    assert notice == {
        "batch_end": 7, "signal": "SIGTERM", "worker": 1, "resumed_from": 40,
    }  # fmt: skip
    # A worker signalled a moment later gets the notice already in force.
    assert second.publish(8, signal.SIGINT, worker=0) == notice
    assert second.read() == notice
    assert names_in(store) == [ClusterNotice.NAME]  # No temporary files left.
    assert store.checkpoints() == []  # A notice is never taken for one.


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_cluster_notice_of_an_earlier_run_or_damaged_is_ignored(tmp_path, where):
    store = notice_store(where, tmp_path)
    ClusterNotice(store, resumed_from=40).publish(7, signal.SIGTERM, 1)
    later_run = ClusterNotice(store, resumed_from=47)
    assert later_run.read() is None
    later_run.clear()
    assert store.read_notice(ClusterNotice.NAME) is None
    later_run.clear()  # Nothing to clear: fine.
    for text in ["{", "[]", '{"batch_end": "7", "signal": "SIGTERM", '
                 '"resumed_from": 47}', '{"batch_end": 7, "signal": "SIGNOPE", '
                 '"resumed_from": 47}']:  # fmt: skip
        later_run.clear()
        assert store.create_notice(ClusterNotice.NAME, text.encode())
        assert later_run.read() is None, text


def test_notice_names_are_plain():
    with pytest.raises(ValueError, match="Not a notice name"):
        CheckpointStore("/tmp/unused").create_notice("../escape.json", b"{}")


class _Training:
    """Stands for fit()'s CallbackList: held by the training loop's frame."""


def _training_that_raises(watcher: PreemptionWatcher) -> None:
    training = _Training()  # noqa: F841 - held by this frame while it runs.
    watcher.install(training=training)
    raise RuntimeError("the training step failed")


def test_handlers_of_a_training_that_raised_step_aside():
    calls = []

    def user_handler(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGUSR1, user_handler)
    watcher = PreemptionWatcher((signal.SIGUSR1,), grace_period=30)
    try:
        with pytest.raises(RuntimeError):
            _training_that_raises(watcher)  # No uninstall(), like fit().
        assert signal.getsignal(signal.SIGUSR1) == watcher._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]  # Passed on as if we were not there,
        assert watcher.received is None  # not taken for a preemption,
        assert signal.getsignal(signal.SIGUSR1) is user_handler  # and undone.
    finally:
        watcher.done()
        watcher.uninstall()
        signal.signal(signal.SIGUSR1, old)


def test_ctrl_c_after_a_training_that_raised_is_a_keyboard_interrupt():
    # Python's own handler, even where the suite runs with SIGINT ignored
    # (a background job); conftest puts the suite's back afterwards.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = PreemptionWatcher((signal.SIGINT,), grace_period=30)
    try:
        with pytest.raises(RuntimeError):
            _training_that_raises(watcher)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert watcher.received is None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        watcher.done()
        watcher.uninstall()


def test_a_new_training_removes_a_stale_watcher_below_it():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stale = PreemptionWatcher((signal.SIGINT,), grace_period=30)
    live = PreemptionWatcher((signal.SIGINT,), grace_period=30)
    try:
        with pytest.raises(RuntimeError):
            _training_that_raises(stale)
        training = _Training()
        assert live.install(training=training)
        os.kill(os.getpid(), signal.SIGINT)  # No KeyboardInterrupt from below.
        assert live.received == signal.SIGINT and stale.received is None
        live.done()
        live.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for watcher in (stale, live):
            watcher.done()
            watcher.uninstall()


def test_a_watcher_reinstalled_after_its_training_raised_is_in_the_chain_once():
    watcher = PreemptionWatcher((signal.SIGUSR1,), grace_period=30)
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with pytest.raises(RuntimeError):
            _training_that_raises(watcher)
        training = _Training()
        assert watcher.install(training=training)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.received == signal.SIGUSR1
        watcher.done()
        watcher.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        watcher.done()
        watcher.uninstall()
        signal.signal(signal.SIGUSR1, old)


def assert_still_alive(code: str, *args: str) -> None:
    """Runs `code` in a new interpreter: it must end by itself, printing
    "alive" (not be ended by a grace period it should never have started)."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))},
    )  # fmt: skip
    assert result.returncode == 0 and "alive" in result.stdout, (
        result.returncode, result.stdout,
    )  # fmt: skip


@ONCE
def test_a_signal_seen_after_the_handlers_are_gone_ends_nothing():
    """The sentinel's thread may read a signal after `uninstall()`: it must
    not start a grace period that ends the process later (twenty tries)."""
    code = textwrap.dedent(
        """
        import os, signal, time
        from keras_ft.training.preemption import PreemptionWatcher

        for _ in range(20):
            watcher = PreemptionWatcher((signal.SIGTERM,), grace_period=0.2)
            watcher.install()
            os.kill(os.getpid(), signal.SIGTERM)
            watcher.uninstall()
        time.sleep(1.0)
        print("alive")
        """
    )
    assert_still_alive(code)


def test_a_watcher_can_be_deep_copied_as_keras_tuner_does():
    watcher = PreemptionWatcher((signal.SIGTERM,), grace_period=1.0)
    watcher.install()
    try:
        copied = copy.deepcopy(watcher)
    finally:
        watcher.uninstall()
    assert copied.signals == watcher.signals and copied.grace_period == 1.0
    copied.install()
    copied.uninstall()


@ONCE
def test_a_signal_for_a_handler_that_was_replaced_ends_nothing():
    """A watcher left installed (its fit() raised) whose handler someone
    replaced since: a later signal is not its, and starts no grace period."""
    code = textwrap.dedent(
        """
        import os, signal, time
        from keras_ft.training.preemption import PreemptionWatcher

        signal.signal(signal.SIGINT, signal.default_int_handler)
        stale = PreemptionWatcher((signal.SIGINT,), grace_period=0.3)
        stale.install()  # Never uninstalled, as after a fit() that raised.
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # Replaced.
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.5)
        print("alive")
        """
    )
    assert_still_alive(code)


@ONCE
@pytest.mark.parametrize("early", [False, True], ids=["idle", "at-fork"])
def test_a_signal_to_a_forked_worker_is_not_the_trainings(early):
    """Keras' worker processes (a `PyDataset` with `use_multiprocessing`) are
    forked while the handlers are in place, and `multiprocessing.Pool` ends
    them with SIGTERM: each must die of it, as without keras-ft, and the
    training process must not take it for its own preemption. Also when the
    signal comes before the child has run its fork hooks (`early`: a loaded
    machine may take milliseconds to schedule a child at all)."""
    code = textwrap.dedent(
        """
        import multiprocessing, os, signal, sys, time

        EARLY = sys.argv[1] == "True"
        if EARLY:  # A hook registered first runs first in the child.
            os.register_at_fork(
                after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM)
            )

        from keras_ft.training.preemption import PreemptionWatcher

        def idle(ready):
            ready.set()
            time.sleep(60)

        watcher = PreemptionWatcher((signal.SIGTERM,), grace_period=0.3)
        assert watcher.install()  # In charge until uninstall(), as in fit().
        fork = multiprocessing.get_context("fork")
        workers = []
        for _ in range(2):
            ready = fork.Event()
            workers.append(fork.Process(target=idle, args=(ready,), daemon=True))
            workers[-1].start()
            if not EARLY:
                assert ready.wait(30)
                os.kill(workers[-1].pid, signal.SIGTERM)
        for worker in workers:
            worker.join(30)
        assert [w.exitcode for w in workers] == [-signal.SIGTERM] * 2, workers
        time.sleep(1.5)  # Past the grace period a wrong one would start.
        assert watcher.received is None
        watcher.uninstall()
        print("alive")
        """
    )
    assert_still_alive(code, str(early))


# A SIGTERM anywhere in fit(), and the same script run again.

PREEMPTED_SCRIPT = os.path.join(os.path.dirname(__file__), "preempted_script.py")


def _preempted_run(work, *args: str) -> subprocess.CompletedProcess:
    backup, out = str(work / "backup"), str(work / "out")
    return subprocess.run(
        [sys.executable, PREEMPTED_SCRIPT, backup, out, *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "moment, backed_up",
    [
        pytest.param(
            "validation",
            "epoch 2, batch 6",  # The epoch's training is over.
            id="validation",
        ),
        # Where the signal lands, the backend does not matter: once each.
        pytest.param(
            "first_step",
            "epoch 1, batch 1",  # While the first step compiles.
            marks=run_once_on("torch", "the signal's path is the same"),
        ),
        pytest.param(
            "epoch_end",
            "epoch 3, batch 1",  # In a later callback's on_epoch_end.
            marks=run_once_on("tensorflow", "the signal's path is the same"),
        ),
    ],
)
def test_a_sigterm_anywhere_in_fit_backs_up_and_the_rerun_ends_as_uninterrupted(
    tmp_path, moment, backed_up
):
    whole = _preempted_run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    signalled = _preempted_run(tmp_path / "signalled", "--signal-at", moment)
    assert signalled.returncode == 128 + signal.SIGTERM, signalled.stderr[-3000:]
    assert f"backed up {backed_up} to" in signalled.stdout + signalled.stderr
    rerun = _preempted_run(tmp_path / "signalled")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    loaded = []
    for name in ("whole", "signalled"):
        with np.load(tmp_path / name / "out.npz") as saved:
            loaded.append([saved[k] for k in sorted(saved)])
    for want, got in zip(*loaded, strict=True):
        np.testing.assert_array_equal(got, want)
