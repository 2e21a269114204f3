"""NanGuard: roll back bitwise to the last good backup and go on, or stop."""

from __future__ import annotations

import os

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import BATCH_SIZE, STEPS_PER_EPOCH, iterations, make_model, weights_of

import keras_ft
from keras_ft import compat
from keras_ft.backend import device_memory, finiteness, host_memory
from keras_ft.training import batch_ends

NAN_BATCH = 2  # Zero-based: the third batch of each epoch is poisoned.
# With keras-ft's callbacks alone, Keras calls the batch ends off the training
# thread (JAX, PyTorch): the guard finds a NaN one batch later.
DEFERRED = batch_ends.deferrable()


class Synced(keras.callbacks.Callback):
    """A batch end that is not async-safe: Keras then calls every batch end
    on the training thread, with the step's logs."""

    def on_train_batch_end(self, batch, logs=None):
        pass


def poisoned(data):
    x, y = data
    x = x.copy()
    x[NAN_BATCH * BATCH_SIZE : (NAN_BATCH + 1) * BATCH_SIZE] = np.nan
    return x, y


class RecordRollback(keras_ft.CheckpointListener):
    """Right after each rollback: the model's variables, and the checkpoint's
    own, read into a fresh model of the same build."""

    def __init__(self, model):
        self.model = model
        self.after: list[list[np.ndarray]] = []
        self.saved: list[list[np.ndarray]] = []

    def after_restore(self, path, epoch, step):
        self.after.append(weights_of(self.model) + optimizer_values(self.model))
        fresh = make_model()
        fresh.optimizer.build(fresh.trainable_variables)
        keras_ft.load_checkpoint(path, fresh)
        self.saved.append(weights_of(fresh) + optimizer_values(fresh))


class LastBatchLogs(keras.callbacks.Callback):
    """The logs of every batch end, by epoch and batch (on whatever thread
    Keras calls it)."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.epoch = 0
        self.logs: dict[tuple[int, int], dict] = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.logs[self.epoch, batch] = {k: float(v) for k, v in (logs or {}).items()}


def optimizer_values(model):
    return [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]


@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.parametrize("synced", [True, False], ids=["synced", "deferred"])
def test_rollback_restores_the_last_backup_bitwise_and_finishes(
    backup_dir, data, async_save, synced, capsys
):
    x, y = poisoned(data)
    model = make_model()
    record = RecordRollback(model)
    guard = keras_ft.NanGuard()
    batches = LastBatchLogs()
    history = model.fit(
        x, y, epochs=1, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(
                backup_dir, save_freq=1, keep=10, async_save=async_save,
                listeners=[record], delete_checkpoint=False,
            ),
            guard,
            batches,
        ] + ([Synced()] if synced else []),
    )  # fmt: skip
    # The NaN batch came after two good ones: rolled back to step 2.
    assert [step for _, step in guard.rollbacks] == [2]
    assert f"at epoch 1, batch {NAN_BATCH + 1}; rolled back" in capsys.readouterr().out
    assert len(record.after) == 1
    for now, saved in zip(record.after[0], record.saved[0], strict=True):
        np.testing.assert_array_equal(now, saved)
    assert all(np.isfinite(w).all() for w in weights_of(model))
    assert guard.stopped is None
    if synced or not DEFERRED:
        # Then the last batch trained: the fit finished, finite, and the
        # epoch logs the metrics of the batch after the rollback.
        assert iterations(model) == 3
        assert history.history["loss"] == [batches.logs[0, NAN_BATCH + 1]["loss"]]
    else:
        # Found at the epoch's end, the last batch trained on the NaN state
        # and was undone with it.
        assert iterations(model) == 2


@pytest.mark.parametrize("synced", [True, False], ids=["synced", "deferred"])
def test_an_epoch_rolled_back_at_its_end_logs_the_state_it_went_back_to(
    backup_dir, data, synced, recwarn
):
    """No step followed the rollback in that epoch: `History` gets the logs of
    the backup rolled back to, not a mean that held the NaN (found at the
    epoch's end) or the 0 of metrics reset with no batch since (found at the
    last batch's end)."""
    x, y = data
    x = x.copy()
    last = STEPS_PER_EPOCH - 1
    x[last * BATCH_SIZE :] = np.nan  # The epoch's last batch.
    model = make_model()
    guard = keras_ft.NanGuard()
    batches = LastBatchLogs()
    history = model.fit(
        x, y, epochs=2, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[
            keras_ft.BackupAndRestore(backup_dir, save_freq=1, delete_checkpoint=False),
            guard,
            batches,
        ] + ([Synced()] if synced else []),
    )  # fmt: skip
    # Each epoch went back to the backup taken after its batch `last - 1`.
    assert [step for _, step in guard.rollbacks] == [last, 2 * last]
    assert guard.stopped is None
    expected = [batches.logs[epoch, last - 1]["loss"] for epoch in (0, 1)]
    assert np.isfinite(expected).all() and min(expected) > 0
    assert history.history["loss"] == pytest.approx(expected)
    # The fit ended on the state of its last backup: nothing to warn of.
    assert not [w for w in recwarn if "was not backed up" in str(w.message)]
    # A backup of the epoch's end made after the rollback holds those logs
    # too, whatever the callbacks' order: a later rollback to it logs them.
    point = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    assert point.extra["logs"]["loss"] == pytest.approx(expected[-1])


@pytest.mark.parametrize("synced", [True, False], ids=["synced", "deferred"])
def test_an_epoch_rolled_back_to_an_epoch_end_logs_its_metrics(
    backup_dir, data, synced
):
    """Back to the last epoch's end, the epoch logs what that one did: its
    validation too where it ran on the diverged state (found at the epoch's
    end), and its own where it ran on the state rolled back to."""
    x, y = data

    def batches():
        for epoch in range(2):
            for i in range(STEPS_PER_EPOCH):
                xb = x[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]
                if epoch == 1 and i == STEPS_PER_EPOCH - 1:
                    xb = np.full_like(xb, np.nan)
                yield xb, y[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]

    model = make_model()
    guard = keras_ft.NanGuard()
    history = model.fit(
        batches(), epochs=2, steps_per_epoch=STEPS_PER_EPOCH, shuffle=False, verbose=0,
        validation_data=(x, y),
        callbacks=[
            keras_ft.BackupAndRestore(backup_dir, delete_checkpoint=False),
            guard,
        ] + ([Synced()] if synced else []),
    )  # fmt: skip
    assert [step for _, step in guard.rollbacks] == [STEPS_PER_EPOCH]
    logged = history.history
    assert np.isfinite(logged["loss"]).all() and np.isfinite(logged["val_loss"]).all()
    assert logged["loss"][1] == pytest.approx(logged["loss"][0])
    assert logged["val_loss"][1] == pytest.approx(logged["val_loss"][0])
    # The newest backup (of the second epoch's end where the rollback came
    # before it, else of the first's) holds them too, though BackupAndRestore
    # ran its epoch end first: a later rollback to it logs them.
    point = keras_ft.WorkerTrainingState(make_model(), backup_dir).restore()
    assert point.extra["logs"]["loss"] == pytest.approx(logged["loss"][0])


@pytest.mark.parametrize("skip_batches", [0, 2])
@pytest.mark.parametrize("synced", [True, False], ids=["synced", "deferred"])
def test_a_nan_found_a_batch_later_skips_as_many_batches(
    backup_dir, data, skip_batches, synced
):
    """Found one batch behind, the batch trained on the diverged state is
    undone by the rollback: it is one of the `skip_batches`."""
    x, y = data
    x = x.copy()
    batch_size = BATCH_SIZE // 2  # 8 batches: found at a batch's begin.
    x[NAN_BATCH * batch_size : (NAN_BATCH + 1) * batch_size] = np.nan
    model = make_model()
    guard = keras_ft.NanGuard(skip_batches=skip_batches)
    model.fit(
        x, y, epochs=1, batch_size=batch_size, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=1), guard]
        + ([Synced()] if synced else []),
    )  # fmt: skip
    assert [step for _, step in guard.rollbacks] == [NAN_BATCH]
    after = 2 * STEPS_PER_EPOCH - NAN_BATCH - 1  # Batches after the NaN one.
    if skip_batches:  # The same in either case.
        assert iterations(model) == NAN_BATCH + after - skip_batches
    else:  # The one trained on the NaN state is not replayed.
        lost = 0 if synced or not DEFERRED else 1
        assert iterations(model) == NAN_BATCH + after - lost


def test_weights_gone_non_finite_with_a_finite_loss_are_caught(backup_dir, data):
    """As a NaN batch through a ReLU does on TensorFlow: here, put there."""
    x, y = data

    class Poison(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == NAN_BATCH:
                kernel = self.model.trainable_variables[0]
                value = keras.ops.convert_to_numpy(kernel).copy()
                value[0, 0] = np.inf
                kernel.assign(value)

    model = make_model()
    guard = keras_ft.NanGuard()
    model.fit(
        x, y, epochs=1, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=2), Poison(), guard],
    )  # fmt: skip
    assert [step for _, step in guard.rollbacks] == [2]
    assert iterations(model) == 3
    assert all(np.isfinite(w).all() for w in weights_of(model))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_device_check_finds_a_nan_or_an_infinity_in_any_variable(dtype):
    """The check a GPU runs (one reduction, one boolean back), on this
    backend's own tensors."""
    big = float(ml_dtypes.finfo(dtype).max) / 10  # Finite; its sum overflows.
    values = [
        keras.Variable(np.full((40, 25), big), dtype=dtype),
        keras.Variable(np.arange(5), dtype="int32", trainable=False),
        keras.Variable(np.ones(7), dtype=dtype),
    ]
    assert finiteness.device_all_finite(values)
    for bad in (np.nan, np.inf, -np.inf):
        for variable in (values[0], values[2]):
            before = keras.ops.convert_to_numpy(variable)
            poisoned_value = np.array(before, copy=True)
            poisoned_value.reshape(-1)[-1] = bad
            variable.assign(poisoned_value)
            assert not finiteness.device_all_finite(values), (bad, variable.path)
            variable.assign(before)
    assert finiteness.device_all_finite(values)
    assert finiteness.device_all_finite([values[1]])
    assert finiteness.device_all_finite([])


def test_on_an_accelerator_the_weights_are_checked_there(backup_dir, data, monkeypatch):
    """No weight is read into host memory at a batch whose state is finite;
    the one that is not is still named, and rolled back from."""
    monkeypatch.setattr(device_memory, "accelerator", lambda value: "gpu")
    real_view, read = host_memory.view, []

    def counted_view(value):
        read.append(value)
        return real_view(value)

    monkeypatch.setattr(host_memory, "view", counted_view)
    x, y = data
    guard = keras_ft.NanGuard()
    model = make_model()
    model.fit(x, y, epochs=1, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
              callbacks=[guard])  # fmt: skip
    assert guard.stopped is None
    assert read == []

    class Poison(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == NAN_BATCH:
                bias = self.model.trainable_variables[-1]
                bias.assign(np.full(bias.shape, np.inf, "float32"))

    model = make_model()
    guard = keras_ft.NanGuard(on_nan="stop")
    model.fit(
        x, y, epochs=1, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=1), Poison(), guard],
    )  # fmt: skip
    bias = model.trainable_variables[-1]
    assert f"{bias.path} holds NaN or infinity" in guard.stopped
    assert iterations(model) == NAN_BATCH + 1


def test_lr_factor_and_skip_batches(backup_dir, data):
    x, y = poisoned(data)
    model = make_model()
    guard = keras_ft.NanGuard(lr_factor=0.5, skip_batches=1)
    model.fit(
        x, y, epochs=1, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=1), guard],
    )  # fmt: skip
    # Rolled back to step 2, and the one batch after the NaN one was skipped.
    assert iterations(model) == 2
    learning_rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    assert learning_rate == pytest.approx(1e-2 * 0.5)


def test_after_max_rollbacks_it_stops_and_keeps_the_backup(backup_dir, data, capsys):
    x, y = poisoned(data)
    model = make_model()
    guard = keras_ft.NanGuard(max_rollbacks=1)
    history = model.fit(
        x, y, epochs=3, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=1), guard],
    )  # fmt: skip
    assert len(guard.rollbacks) == 1
    assert "max_rollbacks=1" in guard.stopped
    assert history.epoch == [0, 1]
    assert "backup of the last good state is kept" in capsys.readouterr().out
    steps = [c.step for c in keras_ft.watch(backup_dir, timeout=0)]
    # Epoch 1 ended at step 3 (rolled back once); epoch 2 backed up 2 more.
    # (Found at the epoch's end, a batch later: the last batch was undone.)
    assert steps[-1] == (2 if DEFERRED else 3) + NAN_BATCH


def test_stop_keeps_the_backup_even_after_the_last_epoch(backup_dir, data, capsys):
    x, y = data
    x = x.copy()
    x[-BATCH_SIZE:] = np.nan  # The very last batch of the only epoch.
    model = make_model()
    guard = keras_ft.NanGuard(on_nan="stop")
    model.fit(
        x, y, epochs=1, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, save_freq=1), guard],
    )  # fmt: skip
    assert guard.stopped.startswith("NanGuard:")
    assert os.path.isdir(backup_dir)
    steps = [c.step for c in keras_ft.watch(backup_dir, timeout=0)]
    assert steps[-1] == STEPS_PER_EPOCH - 1  # The last finite state.


def test_without_a_backup_it_stops(data):
    x, y = poisoned(data)
    model = make_model()
    guard = keras_ft.NanGuard()
    model.fit(x, y, epochs=2, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
              callbacks=[guard])  # fmt: skip
    assert "no keras_ft.BackupAndRestore" in guard.stopped
    # Found a batch later: at the end of this 4-batch epoch.
    assert iterations(model) == (STEPS_PER_EPOCH if DEFERRED else NAN_BATCH + 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"on_nan": "retry"}, "on_nan='retry'"),
        ({"max_rollbacks": -1}, "max_rollbacks=-1"),
        ({"skip_batches": 1.5}, "skip_batches=1.5"),
        ({"lr_factor": 0}, "lr_factor=0"),
        ({"lr_factor": 2.0}, "lr_factor=2.0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match="Invalid value for argument") as raised:
        keras_ft.NanGuard(**kwargs)
    assert message in str(raised.value)


@pytest.mark.skipif(not DEFERRED, reason="TensorFlow's Keras calls batch ends in line")
def test_the_guard_leaves_keras_dispatching_steps_ahead(backup_dir, data):
    """Async-safe: with the guard, Keras still calls the batch ends on a
    thread of its own rather than waiting for every step's logs."""
    import threading

    class Where(keras.callbacks.Callback):
        async_safe = True

        def __init__(self):
            super().__init__()
            self.threads = set()

        def on_train_batch_end(self, batch, logs=None):
            self.threads.add(threading.get_ident())

    x, y = data
    where = Where()
    model = make_model()
    model.fit(
        x, y, epochs=2, batch_size=BATCH_SIZE, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir), keras_ft.NanGuard(), where],
    )  # fmt: skip
    assert where.threads and threading.get_ident() not in where.threads


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's state sync")
@pytest.mark.parametrize("live", [True, False], ids=["live state", "synced"])
def test_the_guard_checks_jax_state_without_syncing_it(backup_dir, data, live):
    """Reading `self.model` on JAX copies the trainer's state back into every
    variable (and the next step gathers it again): the guard's check at each
    batch begin reads the state the step returned; without that internal, it
    syncs, and still finds a NaN."""
    x, y = data

    def syncs(callbacks: list, x=x) -> int:
        model = make_model()
        real, calls = model.jax_state_sync, []
        model.jax_state_sync = lambda: (calls.append(1), real())[1]
        model.fit(x, y, epochs=4, batch_size=BATCH_SIZE, verbose=0, shuffle=False,
                  callbacks=callbacks)  # fmt: skip
        return len(calls)

    with compat.disabled(*([] if live else ["jax_live_state"])):
        with_guard = syncs([keras_ft.NanGuard()])
        # Keras' own, and the guard's: at train begin, each epoch's end.
        if live:
            assert with_guard <= syncs([]) + 1 + 4
        else:  # And at each batch begin after the first.
            assert with_guard >= syncs([]) + 4 * (STEPS_PER_EPOCH - 1)
        guard = keras_ft.NanGuard(on_nan="stop")
        syncs([guard], x=poisoned(data)[0])
    assert f"at epoch 1, batch {NAN_BATCH + 1}; stopping" in guard.stopped
