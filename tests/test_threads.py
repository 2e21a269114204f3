"""BackgroundWriter and Watermark: one write at a time in order, a bounded
queue, no lost error, a thread that outlives a write but not the writer."""

from __future__ import annotations

import threading

import pytest

from keras_ft.threads import BackgroundWriter, Cancelled, Pool, Watermark


@pytest.fixture
def writer():
    """A writer of its own thread, ended after the test."""
    writer = BackgroundWriter()
    yield writer
    writer._pool.close()


def held_write(name, gate, log, result=None):
    """A write that waits at `gate`, then logs."""

    def write():
        log.append(f"{name} started")
        assert gate.wait(timeout=60)
        log.append(f"{name} committed")
        return result if result is not None else name

    return write


def test_writes_run_one_at_a_time_in_the_order_handed_over(writer):
    first_gate, second_gate, log = threading.Event(), threading.Event(), []
    writer.submit(held_write("first", first_gate, log))
    writer.submit(held_write("second", second_gate, log))
    # Both submit() calls returned while the first write is held at its gate.
    while "first started" not in log:
        first_gate.wait(0.01)
    second_gate.set()  # The second is ready first, yet starts second.
    first_gate.wait(0.2)
    assert writer.busy and log == ["first started"]
    first_gate.set()
    assert writer.wait() == "second"
    assert log == [
        "first started", "first committed", "second started", "second committed",
    ]  # fmt: skip
    assert not writer.busy


def test_a_third_write_waits_until_the_first_has_ended(writer):
    gate, log = threading.Event(), []
    writer.submit(held_write("first", gate, log))
    writer.submit(held_write("second", gate, log))
    threading.Timer(0.3, gate.set).start()
    writer.submit(held_write("third", gate, log))  # Returns once first ended.
    assert "first committed" in log
    assert writer.wait() == "third"
    assert log.index("first committed") < log.index("third started")


def test_an_error_is_raised_at_the_next_look_and_only_once(writer):

    def fail():
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    writer._pending[0].join()
    with pytest.raises(OSError, match="No space"):
        writer.raise_if_failed()
    writer.raise_if_failed()  # Raised once, then gone.
    writer.submit(fail)
    writer.submit(lambda: "ok")
    with pytest.raises(OSError):
        writer.submit(lambda: "later")  # A third save sees it,
    assert writer.wait() == "ok"  # and is not started.


def test_wait_waits_for_every_write_and_raises_the_first_error(writer):
    gate, log = threading.Event(), []

    def fail():
        raise OSError(5, "Input/output error")

    writer.submit(fail)
    writer.submit(held_write("second", gate, log))
    threading.Timer(0.2, gate.set).start()
    with pytest.raises(OSError, match="Input/output"):
        writer.wait()
    assert log == ["second started", "second committed"]  # Not abandoned.
    assert not writer.busy


def test_raise_if_failed_does_not_wait(writer):
    gate = threading.Event()

    def fail_after_gate():
        gate.wait(timeout=60)
        raise OSError(5, "Input/output error")

    writer.submit(fail_after_gate)
    writer.raise_if_failed()  # Returns at once: the write is held at the gate.
    gate.set()
    with pytest.raises(OSError, match="Input/output"):
        writer.wait()


def test_a_cancelled_write_has_neither_result_nor_error(writer):

    def cancelled():
        raise Cancelled("called off")

    writer.submit(cancelled)
    assert writer.wait() is None


def test_watermark_lets_a_waiter_through_once_the_level_is_reached():
    mark, reached = Watermark(100), []

    def wait():
        mark.wait_for(60)
        reached.append(mark.level)

    thread = threading.Thread(target=wait)
    thread.start()
    mark.advance(50)
    thread.join(timeout=0.2)
    assert thread.is_alive() and reached == []  # 50 < 60: still waiting.
    mark.advance(70)
    thread.join(timeout=60)
    assert reached == [70]
    mark.finish()
    assert mark.level == 100
    mark.wait_for(1000)  # Past the end means the end.


def test_an_abandoned_watermark_calls_its_waiters_off():
    mark, errors = Watermark(100), []

    def wait():
        try:
            mark.wait_for(100)
        except Cancelled as e:
            errors.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    mark.advance(40)
    mark.abandon(RuntimeError("the copy failed"))
    thread.join(timeout=60)
    assert len(errors) == 1 and "the copy failed" in str(errors[0])
    mark.wait_for(40)  # What was ready stays ready.


def test_a_writes_value_never_waits_or_raises(writer):
    gate = threading.Event()
    failing = writer.submit(lambda: (gate.wait(timeout=60), 1 / 0))
    assert failing.value is None  # Still running: no waiting.
    gate.set()
    failing.join()
    assert failing.value is None  # Failed: no result, and no raise.
    with pytest.raises(ZeroDivisionError):
        writer.wait()
    done = writer.submit(lambda: "committed")
    done.join()
    assert done.value == "committed"


def test_a_writer_keeps_its_threads_across_writes_and_close_ends_them():
    """Writes run on the writer's own thread, not a thread started per
    write (that cost the training thread ~1 ms a save under load)."""
    ran_on = []
    with BackgroundWriter() as writer:
        for _ in range(20):
            writer.submit(lambda: ran_on.append(threading.current_thread()))
        writer.wait()
        assert len(set(ran_on)) == 1
        assert all(t.name.startswith("keras-ft-checkpoint-writer") for t in ran_on)
        assert all(t.is_alive() for t in ran_on)  # Idle, kept for the next save.
    assert not any(t.is_alive() for t in set(ran_on))  # close() ended them.


def test_close_raises_a_writes_error_and_still_ends_the_threads():
    ran_on = []

    def failing():
        ran_on.append(threading.current_thread())
        raise OSError("disk full")

    writer = BackgroundWriter()
    writer.submit(failing)
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert not ran_on[0].is_alive()
    writer.submit(lambda: "again")  # A later write starts them again.
    assert writer.wait() == "again"
    writer.close()


# Kept for the life of the process on purpose, idle between fits: the one
# reader of the interpreter's signal wakeup descriptor (training/watchdog.py).
SHARED = {"keras-ft-signals"}


def keras_ft_threads():
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("keras-ft") and t.name not in SHARED
    }


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_a_fit_leaves_no_thread_behind(tmp_path, where):
    """Writers, pools (copy, checksum, fsync, removal, transfers) and the
    lease's heartbeat end with the fit(), kept or deleted backup alike; a
    deleted backup's removal (not waited for) ends by itself."""
    from conftest import make_data, make_model

    import keras_ft
    from keras_ft import threads

    # Trainings of earlier tests that never ended keep their threads (and
    # leases whose heartbeats go on): not this test's.
    before = keras_ft_threads()

    backup = str(tmp_path) if where == "disk" else f"memory://threads-{tmp_path.name}"
    x, y = make_data()
    for keep in (True, False):
        callback = keras_ft.BackupAndRestore(
            backup, save_freq=1, delete_checkpoint=not keep
        )
        make_model().fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
        # A deleted backup's removal, not waited for by fit(), ends by itself.
        threads.wait_for_discards()
        left = sorted(t.name for t in keras_ft_threads() - before)
        assert left == [], keep


@pytest.mark.parametrize("same_callback", [True, False])
def test_a_fit_that_raised_leaves_no_thread_once_the_next_one_ends(
    tmp_path, same_callback
):
    """Keras calls no `on_train_end` for a fit() that raised: the next fit()
    on the backup (with the same callback or a new one) closes what the
    first left, and once it ends no keras-ft thread is left but the
    documented shared one (`keras-ft-signals`, idle)."""
    import keras
    from conftest import make_data, make_model

    import keras_ft
    from keras_ft import threads

    before = keras_ft_threads()  # Earlier tests' trainings' threads.

    class Boom(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("boom")

    x, y = make_data()
    callback = keras_ft.BackupAndRestore(str(tmp_path), save_freq=1)
    with pytest.raises(RuntimeError, match="boom"):
        make_model().fit(x, y, epochs=2, batch_size=16, verbose=0,
                         callbacks=[callback, Boom()])  # fmt: skip
    assert keras_ft_threads() - before  # The raised fit()'s pools, idle.
    if not same_callback:
        callback = keras_ft.BackupAndRestore(str(tmp_path), save_freq=1)
    make_model().fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
    threads.wait_for_discards()  # The deleted backup's removal ends by itself.
    assert sorted(t.name for t in keras_ft_threads() - before) == []


def test_a_writer_takes_a_pool_of_one_thread_only():
    with pytest.raises(ValueError, match="pool of one thread"):
        BackgroundWriter(Pool(2, "keras-ft-test-writer"))
