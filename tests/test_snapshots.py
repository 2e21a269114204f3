"""Where a save copies the state: on the device (then moved to host memory
beside the next steps), or in host memory (`state/snapshots.py`)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref

import keras
import numpy as np
import pytest
from conftest import make_data, make_model, subprocess_env

import keras_ft
from keras_ft import events, threads
from keras_ft.backend import device_memory
from keras_ft.state import rng, weights_copy, weights_layout
from keras_ft.state.snapshots import SnapshotPlace


def state_of(model: keras.Model) -> list[np.ndarray]:
    return [
        keras.ops.convert_to_numpy(v) for v in model.weights + model.optimizer.variables
    ]


class SaveOnceMidEpoch(keras.callbacks.Callback):
    """Backs up after batch 2 of epoch 1 while the move to host memory is
    held back, so that the steps after it run before the move does."""

    def __init__(self, state: keras_ft.WorkerTrainingState, gate: threading.Event):
        super().__init__()
        self.state, self.gate = state, gate
        self.expected: list[np.ndarray] | None = None

    def on_train_batch_end(self, batch, logs=None):
        if self.expected is not None or batch != 1:
            return
        model = self.model  # On JAX, reading it syncs the trainer's state.
        self.expected = state_of(model)
        mover = self.state._state.pools.mover
        threads.submit(mover, self.gate.wait)  # The move waits for it.
        self.state.back_up(0, batch + 1)


@pytest.mark.parametrize("mode", ["device", "host"])
def test_a_snapshot_holds_the_state_at_its_step_after_later_steps_ran(tmp_path, mode):
    """Keras' JAX trainer donates the state to the next step and PyTorch's
    optimizers update in place: a snapshot moved to host memory only after
    three more epochs must still hold the values of its own step."""
    x, y = make_data()
    model = make_model(units=64)
    state = keras_ft.WorkerTrainingState(
        model, str(tmp_path / "backup"), async_save=True, snapshot=mode
    )
    gate = threading.Event()
    saver = SaveOnceMidEpoch(state, gate)
    try:
        model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[saver])
    finally:
        gate.set()
    state.wait()  # Committed once the move is let go.
    after = state_of(model)
    changed = zip(after, saver.expected, strict=True)
    assert any(not np.array_equal(a, b) for a, b in changed)  # Trained on.
    restored = make_model(units=64)
    keras_ft.load_checkpoint(str(tmp_path / "backup"), restored)
    for saved, expected in zip(state_of(restored), saver.expected, strict=True):
        np.testing.assert_array_equal(saved, expected)


def test_auto_copies_to_host_memory_on_the_cpu_and_device_where_asked():
    model = make_model()
    variables = model.weights + model.optimizer.variables
    # Host memory on the CPU (these machines); the device on an accelerator.
    on_accelerator = device_memory.accelerator(variables[0]) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The nondeterminism notice, on a GPU.
        auto = SnapshotPlace("auto").on_device(lambda: variables)
    assert auto is on_accelerator
    assert SnapshotPlace("host").on_device(lambda: variables) is False
    assert SnapshotPlace("device").on_device(lambda: variables) is True


@pytest.mark.parametrize("bad", ["gpu", "Device", None, 1, True])
def test_a_bad_snapshot_value_is_named_with_the_choices(tmp_path, bad):
    message = "Invalid value for argument `snapshot`.*'auto', 'device', 'host'"
    with pytest.raises(ValueError, match=message):
        keras_ft.BackupAndRestore(str(tmp_path), snapshot=bad)
    with pytest.raises(ValueError, match=message):
        keras_ft.WorkerTrainingState(make_model(), str(tmp_path), snapshot=bad)


def test_a_device_without_room_for_a_snapshot_copies_to_host_memory(
    tmp_path, monkeypatch
):
    """The device's free memory, as its backend reports it (a hook here:
    these machines have no accelerator), decides before the first save."""
    monkeypatch.setattr(device_memory, "device_free_bytes", lambda value: 16 << 10)
    x, y = make_data()
    model = make_model(units=2000)  # 48,004 bytes of weights; with Adam's, 3x + 12.
    state = keras_ft.WorkerTrainingState(model, str(tmp_path), snapshot="device")
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.back_up(0)
        state.back_up(1)
    said = [str(w.message) for w in caught if "snapshot" in str(w.message)]
    assert len(said) == 1, said  # Once, at the first save.
    gpu = (
        device_memory.accelerator(model.weights[0]) is not None
    )  # On the device machine.
    assert f"no room on the {'GPU' if gpu else 'device'}" in said[0], said
    assert "(140.6 KiB needed, 16.0 KiB free)" in said[0], said  # 144,024 bytes.
    # Decided: not asked again.
    assert state._parts.chief._snapshots.on_device(list) is False
    restored = make_model(units=2000)
    keras_ft.load_checkpoint(str(tmp_path), restored)
    for a, b in zip(state_of(restored), state_of(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_room_enough_keeps_the_snapshot_on_the_device(monkeypatch):
    monkeypatch.setattr(device_memory, "device_free_bytes", lambda value: 1 << 40)
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SnapshotPlace("device").on_device(lambda: model.weights) is True


def test_an_out_of_memory_snapshot_falls_back_to_host_memory(tmp_path, monkeypatch):
    def no_room(values):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(device_memory, "device_snapshot", no_room)
    # The rest of the state is read once a save: in a cluster such a read
    # may be a collective, which a process falling back alone must not repeat.
    reads = []
    capture = rng.capture
    monkeypatch.setattr(rng, "capture", lambda: reads.append(1) or capture())
    x, y = make_data()
    model = make_model()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    state = keras_ft.WorkerTrainingState(model, str(tmp_path), snapshot="device")
    with pytest.warns(UserWarning, match="ran out of memory.*host memory"):
        assert state.back_up(0) is not None
    assert len(reads) == 1
    state.back_up(1)  # From host memory now, without a second notice.
    assert len(reads) == 2


def test_the_nondeterminism_notice_says_how_once(monkeypatch):
    """On an accelerator with nondeterministic kernels, the first save says
    that no run there is bitwise reproducible, and what makes it so."""
    monkeypatch.setattr(device_memory, "accelerator", lambda value: "gpu")
    monkeypatch.setattr(events, "_said", set())
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("TF_DETERMINISTIC_OPS", raising=False)
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SnapshotPlace("host").on_device(lambda: model.weights)
        SnapshotPlace("auto").on_device(lambda: model.weights)
    said = [str(w.message) for w in caught if "reproducible" in str(w.message)]
    assert len(said) == 1, said
    fix = {
        "jax": "XLA_FLAGS=--xla_gpu_deterministic_ops=true",
        "torch": "torch.use_deterministic_algorithms(True), with "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8",
        "tensorflow": "tf.config.experimental.enable_op_determinism()",
    }[keras.backend.backend()]
    assert "no run here is bitwise reproducible" in said[0] and fix in said[0]


def test_no_nondeterminism_notice_once_determinism_is_set(monkeypatch):
    monkeypatch.setattr(device_memory, "accelerator", lambda value: "gpu")
    monkeypatch.setattr(events, "_said", set())
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("TF_DETERMINISTIC_OPS", "1")
    on_torch = keras.backend.backend() == "torch"
    if on_torch:
        import torch

        torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            SnapshotPlace("auto").on_device(lambda: make_model().weights)
    finally:
        if on_torch:
            torch.use_deterministic_algorithms(False)


_KILLED_MID_MOVE = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, sys.argv[2])
    from conftest import make_data, make_model
    import keras_ft
    from keras_ft import threads
    x, y = make_data()
    model = make_model(units=2000)
    state = keras_ft.WorkerTrainingState(
        model, sys.argv[1], async_save=True, snapshot="device")
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    state.back_up(0)
    state.wait()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    mover = state._state.pools.mover
    threads.submit(mover, threading.Event().wait)  # The move never runs.
    state.back_up(1)
    print("moving", flush=True)
    threading.Event().wait()
    """
)


def test_a_kill_during_the_move_to_host_memory_leaves_the_last_backup(tmp_path):
    backup = str(tmp_path / "backup")
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_MOVE, backup, os.path.dirname(__file__)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert child.stdout.readline().strip() == "moving", child.stderr.read()
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
    model = make_model(units=2000)
    point = keras_ft.WorkerTrainingState(model, backup).restore()
    assert (
        point is not None
        and point.epoch == 1
        and point.checkpoint.endswith("ckpt-00000001")
    )


def test_one_snapshot_on_the_device_at_a_time(tmp_path, monkeypatch):
    """Saving every batch, the next snapshot is made only once the last one
    was moved to host memory and let go: the device holds at most one copy
    of the state beyond training's."""
    made_by_device = device_memory.device_snapshot
    alive: list[weakref.ref] = []
    counts = []

    def counted(values):
        gc.collect()
        counts.append(sum(ref() is not None for ref in alive))
        copies, made = made_by_device(values)
        alive.extend(weakref.ref(c) for c in copies)
        return copies, made

    monkeypatch.setattr(device_memory, "device_snapshot", counted)
    x, y = make_data()
    model = make_model(units=256)
    save = keras_ft.BackupAndRestore(str(tmp_path), save_freq=1, snapshot="device")
    model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[save])
    assert len(counts) == 8 and counts == [0] * 8, counts


def test_a_device_snapshot_lands_once_the_last_write_is_over_and_is_written_as_it_lands(
    monkeypatch,
):
    """One snapshot in flight: the next snapshot's move into the one host
    buffer waits in the background (training does not) until the last
    write from the buffer is over; then the writer follows the values
    landed (the check between)."""
    monkeypatch.setattr(weights_copy, "_COPY_BATCH", 1)  # A batch per piece.
    model = make_model(units=64)
    model.optimizer.build(model.trainable_variables)
    layout = weights_layout.WeightsLayout(model)
    first = layout.capture(fill=False, on_device=True)
    first.fill()
    first.filled.wait_for(first.filled.total)
    total = first.filled.total

    second = layout.capture(fill=False, on_device=True)  # Returns at once.
    moving = threading.Thread(target=second.fill, daemon=True)
    moving.start()
    moving.join(0.3)
    assert moving.is_alive()  # Waiting for the last write to be over.
    assert second.filled.level == 0

    first.release()  # Its writer is through (as a writer marks it).
    moving.join(30)
    assert not moving.is_alive()
    second.filled.wait_for(total)
    assert not second.non_finite
    second.release()
    whole = layout.capture(copy=True, fill=True)
    assert b"".join(map(bytes, second.chunks)) == b"".join(map(bytes, whole.chunks))


def test_a_save_called_off_stops_its_move_to_host_memory(tmp_path, monkeypatch):
    """At the end of a fit() whose backup is deleted, the last save is called
    off: a move to host memory still waiting stops there, nothing is
    committed, and the next save moves as usual."""
    moves = []
    move_to_host = device_memory.move_to_host
    monkeypatch.setattr(
        device_memory, "move_to_host", lambda *a: moves.append(1) or move_to_host(*a)
    )
    x, y = make_data()
    model = make_model(units=64)
    state = keras_ft.WorkerTrainingState(
        model, str(tmp_path), async_save=True, snapshot="device"
    )
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    gate = threading.Event()
    threads.submit(state._state.pools.mover, gate.wait)  # The move waits behind it.
    state.back_up(0)
    time.sleep(0.2)  # The writer now waits for the move to fill the buffer.
    # Called off while its move has not begun; the move, let go once the
    # call waits for the writer (which waits for the move), stops at once.
    threading.Timer(0.5, gate.set).start()
    state.discard_pending()
    state.wait()
    assert moves == []
    fresh = make_model(units=64)
    assert keras_ft.WorkerTrainingState(fresh, str(tmp_path)).restore() is None
    state.back_up(1)
    state.wait()
    point = keras_ft.WorkerTrainingState(fresh, str(tmp_path)).restore()
    assert point is not None and point.epoch == 2  # Resumes after epoch 1.
    assert moves == [1]
    for a, b in zip(state_of(fresh), state_of(model), strict=True):
        np.testing.assert_array_equal(a, b)


def _on_cuda() -> bool:
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _on_cuda(), reason="page-locked buffers: PyTorch on CUDA")
def test_a_dropped_training_unlocks_its_page_locked_buffer(tmp_path):
    """A training dropped without `close()` unlocks its copy buffer with it:
    the driver would otherwise keep its pages and addresses, and a later
    page-locked allocation there fail (`resource already mapped`, seen on an
    H200)."""
    import torch

    x, y = make_data()
    model = make_model(units=2000)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    for run in range(3):
        state = keras_ft.WorkerTrainingState(
            model, str(tmp_path / str(run)), async_save=True, snapshot="device"
        )
        state.back_up(0)
        state.wait()
        buffer = state._state._weights._buffer
        assert buffer.pinned
        address = np.frombuffer(buffer._image, np.uint8).ctypes.data
        del state, buffer
        gc.collect()
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostUnregister(address)) != 0  # Not locked now.
        device_memory._clear_cuda_error()
    # Page-locked memory is allocated and used afterwards without a CUDA error.
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    assert int(pinned.to("cuda", non_blocking=True).sum()) == 0
