"""WorkerTrainingState on its own, as a custom training loop would use it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings

import keras
import numpy as np
import pytest
from conftest import (
    TESTS_DIR,
    iterations,
    make_data,
    make_model,
    run_once_on,
    subprocess_env,
    tree_digest,
    weights_of,
)

import keras_ft
import keras_ft.checkpoint.store
import keras_ft.saves.save
from keras_ft import (
    BackupAndRestore,
    DirectoryInUseError,
    NonFiniteStateError,
    TaskSpec,
    WorkerTrainingState,
)


def train_epochs(model, data, first, last, state):
    x, y = data
    for epoch in range(first, last):
        for i in range(0, len(x), 16):
            model.train_on_batch(x[i : i + 16], y[i : i + 16])
        state.back_up(epoch)


def test_custom_loop_backs_up_and_resumes(backup_dir, data):
    model = make_model()
    state = WorkerTrainingState(model, backup_dir)
    assert state.restore() is None
    train_epochs(model, data, 0, 3, state)
    assert [c.sequence for c in state.checkpoints()] == [2, 3]  # keep=2

    fresh = make_model()
    resume = WorkerTrainingState(fresh, backup_dir).restore()
    assert (resume.epoch, resume.batch, resume.step) == (3, 0, 12)
    assert resume.checkpoint.endswith(os.path.join("chief", "ckpt-00000003"))
    assert iterations(fresh) == 12
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_training_after_a_restore_leaves_the_checkpoint_intact(backup_dir, data):
    # JAX may train on arrays that alias the checkpoint's mapped file, and
    # donate them to the step that overwrites them: only a private copy of
    # the pages may change, never the file.
    model = make_model()
    state = WorkerTrainingState(model, backup_dir)
    train_epochs(model, data, 0, 1, state)
    before = tree_digest(backup_dir)
    saved = [np.array(w) for w in weights_of(model)]
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    restored = WorkerTrainingState(fresh, backup_dir)
    restored.restore()
    for a, b in zip(saved, weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    x, y = data
    for i in range(0, len(x), 16):
        fresh.train_on_batch(x[i : i + 16], y[i : i + 16])
    assert iterations(fresh) == 8
    assert not all(
        np.array_equal(a, b) for a, b in zip(saved, weights_of(fresh), strict=True)
    )
    assert tree_digest(backup_dir) == before
    # Saves go on (over the restored checkpoint's file once it is let go).
    restored.back_up(1)
    restored.back_up(2)
    restored.wait()
    resume = WorkerTrainingState(make_model(), backup_dir).restore()
    assert (resume.epoch, resume.step) == (3, 8)


def test_mid_epoch_back_up_records_the_batch(backup_dir, data):
    model = make_model()
    model.train_on_batch(*[a[:16] for a in data])
    state = WorkerTrainingState(model, backup_dir)
    state.back_up(4, batch=1)
    resume = WorkerTrainingState(make_model(), backup_dir).restore()
    assert (resume.epoch, resume.batch, resume.step) == (4, 1, 1)


def test_delete_backup_keeps_other_files(backup_dir, data):
    os.makedirs(backup_dir)
    with open(os.path.join(backup_dir, "my_notes.txt"), "w") as f:
        f.write("keep me")
    state = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(state.model, data, 0, 1, state)
    state.delete_backup()
    assert os.listdir(backup_dir) == ["my_notes.txt"]


def test_delete_backup_removes_a_directory_it_emptied(backup_dir, data):
    state = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(state.model, data, 0, 1, state)
    state.delete_backup()
    assert not os.path.exists(backup_dir)


def test_non_chief_writes_a_temporary_directory_and_removes_it(
    backup_dir, data, monkeypatch
):
    chief = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(chief.model, data, 0, 1, chief)
    before = tree_digest(backup_dir)

    worker_model = make_model()
    worker = WorkerTrainingState(
        worker_model, backup_dir, task=TaskSpec("worker", 1, 2, False)
    )
    written = []
    original_write = keras_ft.saves.save.write_snapshot

    def spy(snapshot, directory):
        written.append(directory)
        original_write(snapshot, directory)

    monkeypatch.setattr(keras_ft.saves.save, "write_snapshot", spy)
    assert worker.back_up(0) is None
    assert written and os.path.join(backup_dir, "workertemp_1") in written[0].path
    assert not os.path.exists(os.path.join(backup_dir, "workertemp_1"))
    assert tree_digest(backup_dir) == before  # The chief's files are untouched.
    # Every worker restores from the chief's checkpoint.
    assert worker.restore().epoch == 1
    worker.delete_backup()
    assert tree_digest(backup_dir) == before


def test_a_non_chief_save_is_written_in_the_background_from_a_copy(
    backup_dir, data, tmp_path, monkeypatch
):
    """A worker's throwaway save is taken as the chief's: training waits for
    a copy of the state, the write follows in the background (here only
    after more steps ran), and the directory is gone once it is over."""
    x, y = data
    model = make_model()
    worker = WorkerTrainingState(
        model, backup_dir, async_save=True, task=TaskSpec("worker", 1, 2, False)
    )
    gate = threading.Event()
    original_write = keras_ft.saves.save.write_snapshot

    def held_write(snapshot, directory):
        assert gate.wait(60)  # The write begins after the steps below.
        original_write(snapshot, directory)
        kept = str(tmp_path / "kept.weights.h5")
        shutil.copyfile(os.path.join(directory, "model.weights.h5"), kept)

    monkeypatch.setattr(keras_ft.saves.save, "write_snapshot", held_write)
    model.train_on_batch(x[:16], y[:16])
    expected = [keras.ops.convert_to_numpy(w) for w in model.weights]
    assert worker.back_up(0) is None  # Without waiting for the write.
    scratch = os.path.join(backup_dir, "workertemp_1")
    model.train_on_batch(x[16:32], y[16:32])
    gate.set()
    worker.wait()
    assert not os.path.exists(scratch)
    assert not os.path.exists(os.path.join(backup_dir, "chief", "ckpt-00000001"))
    written = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Its optimizer is not built: no matter.
        written.load_weights(str(tmp_path / "kept.weights.h5"))
    assert any(
        not np.array_equal(keras.ops.convert_to_numpy(w), e)
        for w, e in zip(model.weights, expected, strict=True)
    )  # Trained on.
    for w, e in zip(written.weights, expected, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(w), e)
    worker.close()


# Worker 1 of a cluster: it locks its directory, says so, saves when told.
_WORKER_ONE = """
import sys, keras
sys.path.insert(0, sys.argv[2])
from conftest import make_model
from keras_ft import TaskSpec, WorkerTrainingState
state = WorkerTrainingState(
    make_model(), sys.argv[1], task=TaskSpec("worker", 1, 2, False)
)
state.lock()
print("locked", flush=True)
sys.stdin.readline()
state.back_up(0)
state.close()
print("saved", flush=True)
"""


@run_once_on("torch", "locks and processes: the backend does not matter")
def test_a_second_clusters_worker_is_refused_before_it_empties_the_first_ones(
    backup_dir,
):
    """Two clusters on one `backup_dir`: worker 1 of the second is refused
    before it removes anything, and worker 1 of the first saves as before
    (the second used to empty its directory, even in the middle of a save)."""
    first = subprocess.Popen(
        [sys.executable, "-c", _WORKER_ONE, backup_dir, TESTS_DIR],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=subprocess_env(),
    )  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "locked", first.stderr.read()
        second = WorkerTrainingState(
            make_model(), backup_dir, task=TaskSpec("worker", 1, 2, False)
        )
        with pytest.raises(
            DirectoryInUseError, match=f"Worker 1's directory .*pid {first.pid}"
        ):
            second.lock()
        out, err = first.communicate("go\n", timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and out.strip() == "saved", err
    # Nothing of either worker is left beside the backup.
    assert os.listdir(backup_dir) == []


def test_check_writable_names_backup_dir(unwritable_dir):
    state = WorkerTrainingState(make_model(), os.path.join(unwritable_dir, "b"))
    with pytest.raises(ValueError, match="`backup_dir`.*cannot write"):
        state.check_writable()


@pytest.mark.parametrize("mangled", ["s3:/bucket/run", "gs:/b", "memory:/x/y"])
def test_a_url_that_lost_a_slash_never_becomes_a_local_directory(
    mangled, tmp_path, monkeypatch
):
    """`os.path.join()` or `normpath()` turn `s3://b/run` into `s3:/b/run`:
    refused, naming the fix, with nothing made on disk."""
    monkeypatch.chdir(tmp_path)
    scheme = mangled.split(":")[0]
    with pytest.raises(ValueError, match=f"lost a slash.*{scheme}://"):
        WorkerTrainingState(make_model(), mangled)
    x, y = make_data()
    with pytest.raises(ValueError, match="lost a slash"):
        make_model().fit(
            x, y, epochs=1, verbose=0, callbacks=[keras_ft.BackupAndRestore(mangled)]
        )
    assert os.listdir(tmp_path) == []
    WorkerTrainingState(make_model(), f"./{mangled}")  # Said so: a local one.


def test_only_the_lock_holder_removes_a_killed_writers_staging_directory(
    backup_dir,
):
    staging = os.path.join(backup_dir, "chief", ".staging-00000001-999-abcd")
    os.makedirs(staging)
    state = WorkerTrainingState(make_model(), backup_dir)
    state.check_writable()
    assert os.path.isdir(staging)  # Another process may be writing it.
    with state.locked():
        assert not os.path.exists(staging)
    state.unlock()


def test_a_failed_start_releases_the_lock(backup_dir):
    state = WorkerTrainingState(make_model(), backup_dir)
    with pytest.raises(RuntimeError, match="restore failed"), state.locked():
        raise RuntimeError("restore failed")
    other = WorkerTrainingState(make_model(), backup_dir)
    with other.locked():  # Not held any more.
        pass
    other.unlock()


@run_once_on("torch", "a lock and a directory: the backend does not matter")
def test_a_second_trainer_never_breaks_the_first(tmp_path):
    """Trainer A saves every batch (a save in flight most of the time);
    trainer B starts on the same directory again and again while A has a
    staging directory: B is refused, and A finishes untouched."""
    backup = str(tmp_path / "backup")
    chief = os.path.join(backup, "chief")
    script = os.path.join(TESTS_DIR, "train_script.py")
    trainer = subprocess.Popen(
        [sys.executable, script, backup, "--epochs", "6", "--save-freq", "1",
         "--units", "200000", "--keep-backup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(),
    )  # fmt: skip
    refused = 0
    deadline = time.monotonic() + 240
    while refused < 5 and trainer.poll() is None:
        assert time.monotonic() < deadline
        names = os.listdir(chief) if os.path.isdir(chief) else []
        if not any(n.startswith(".staging-") for n in names):
            time.sleep(0.001)
            continue
        second = WorkerTrainingState(make_model(), backup)
        second.check_writable()
        with pytest.raises(DirectoryInUseError, match=f"pid {trainer.pid} on"):
            second.lock()
        refused += 1
    out, err = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, err
    assert refused == 5, "trainer A finished before B was refused five times"
    assert '"kind": "done", "step": 24' in out
    state = WorkerTrainingState(make_model(units=200000), backup)
    assert state.restore().step == 24


def test_fuzzed_newest_checkpoint_always_falls_back_to_the_previous(backup_dir, data):
    """Random byte flips, truncations, deletions and manifest damage in any file
    of the newest checkpoint: every case is caught, with a warning naming the
    problem, and the previous checkpoint is restored."""
    import random
    import shutil
    import warnings

    state = WorkerTrainingState(make_model(), backup_dir)
    train_epochs(state.model, data, 0, 2, state)
    pristine = backup_dir + ".pristine"
    shutil.copytree(backup_dir, pristine)
    rng = random.Random(99)
    newest = os.path.join(backup_dir, "chief", "ckpt-00000002")
    for _ in range(40):
        shutil.rmtree(backup_dir)
        shutil.copytree(pristine, backup_dir)
        name = rng.choice(sorted(os.listdir(newest)))
        path = os.path.join(newest, name)
        size = os.path.getsize(path)
        how = rng.choice(["flip", "truncate", "delete", "append"])
        if how == "flip":
            with open(path, "r+b") as f:
                offset = rng.randrange(size)
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        elif how == "truncate":
            with open(path, "r+b") as f:
                f.truncate(rng.randrange(size))
        elif how == "delete":
            os.remove(path)
        else:
            with open(path, "ab") as f:
                f.write(b"\0")
        fresh = make_model()
        if rng.random() < 0.5:
            # With the optimizer's variables, the weights are read while the
            # checkpoint is checksummed (and dropped when it is damaged).
            fresh.optimizer.build(fresh.trainable_variables)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume = WorkerTrainingState(fresh, backup_dir).restore()
        assert resume.epoch == 1, (name, how)
        assert iterations(fresh) == 4, (name, how)
        messages = " ".join(str(w.message) for w in caught)
        assert "ckpt-00000002 is damaged" in messages, (name, how)


def held_writes(monkeypatch):
    """Makes every snapshot write wait at a gate; returns the gate."""
    gate = threading.Event()
    original = keras_ft.saves.save.write_snapshot

    def write(snapshot, directory):
        assert gate.wait(timeout=60)
        original(snapshot, directory)

    monkeypatch.setattr(keras_ft.saves.save, "write_snapshot", write)
    return gate


def test_an_async_save_returns_before_its_commit(backup_dir, data, monkeypatch):
    gate = held_writes(monkeypatch)
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    state = WorkerTrainingState(model, backup_dir, async_save=True)
    assert state.back_up(0) is None  # Returned while the write is held.
    assert state.writing and state.checkpoints() == []
    gate.set()
    assert state.wait().sequence == 1 and not state.writing
    fresh = make_model()
    WorkerTrainingState(fresh, backup_dir).restore()
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_long_run_of_async_saves_holds_only_the_saves_in_flight(backup_dir, data):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    state = WorkerTrainingState(model, backup_dir, async_save=True)
    for epoch in range(6):
        state.back_up(epoch)
    # What a save in flight needs (to be called off) is not kept past it.
    assert len(state._parts.queue._cancels) <= 2
    assert state.wait().sequence == 6


def test_discarding_a_pending_save_commits_nothing(backup_dir, data, monkeypatch):
    gate = held_writes(monkeypatch)
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    state = WorkerTrainingState(model, backup_dir, async_save=True)
    state.back_up(0)
    threading.Timer(0.2, gate.set).start()  # Released after the call-off.
    state.discard_pending()
    assert state.checkpoints() == [] and not state.writing
    assert os.listdir(os.path.join(backup_dir, "chief")) == []  # No staging left.


_EXIT_WITH_A_WRITE_IN_FLIGHT = """
import sys, time
sys.path.insert(0, sys.argv[2])
from conftest import make_model, make_data
from keras_ft import WorkerTrainingState
from keras_ft.saves import save

original = save.write_snapshot
def slow_write(snapshot, directory):
    time.sleep(1.0)
    original(snapshot, directory)
save.write_snapshot = slow_write

model = make_model()
model.fit(*make_data(), epochs=1, verbose=0)
WorkerTrainingState(model, sys.argv[1], async_save=True).back_up(0)
print("exiting", flush=True)
"""


def test_interpreter_exit_waits_for_the_pending_commit(backup_dir):
    result = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_WRITE_IN_FLIGHT, backup_dir, TESTS_DIR],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout
    assert [
        c.sequence for c in WorkerTrainingState(make_model(), backup_dir).checkpoints()
    ] == [1]


@pytest.mark.parametrize("async_save", [True, False])
def test_non_finite_state_is_refused_by_name_and_commits_nothing(
    backup_dir, data, async_save
):
    model = make_model()
    state = WorkerTrainingState(model, backup_dir, async_save=async_save)
    train_epochs(model, data, 0, 1, state)
    state.wait()
    before = tree_digest(backup_dir)
    kernel = model.layers[1].kernel
    value = np.array(kernel)
    value[0, 0] = np.inf
    kernel.assign(value)
    with pytest.raises(NonFiniteStateError, match="dense_1/vars/0") as e:
        state.back_up(1)
        # In the background, the writer checks the copy and raises later.
        assert async_save
        state.wait()
    assert e.value.variables == ["layers/dense_1/vars/0"]
    # Said of which save, where it is raised after that save returned.
    assert e.value.at == ("epoch 2" if async_save else None)  # One-based.
    state.wait()
    assert tree_digest(backup_dir) == before
    assert [c.sequence for c in state.checkpoints()] == [1]
    # Finite again: saves go on, into the same buffer.
    value[0, 0] = 0.0
    kernel.assign(value)
    state.back_up(1)
    state.wait()
    assert [c.sequence for c in state.checkpoints()] == [1, 2]


def test_roll_back_past_a_save_its_writer_refused(backup_dir, data):
    # A NaN reaches the variables a step before the loss: the save of that
    # step is refused in the background, and a rollback then loads the one
    # before instead of failing on the refusal.
    model = make_model()
    state = WorkerTrainingState(model, backup_dir, async_save=True)
    train_epochs(model, data, 0, 1, state)
    state.wait()  # The buffer is free: the next save's check is in the background.
    good = [np.array(w) for w in weights_of(model)]
    kernel = model.layers[1].kernel
    value = np.array(kernel)
    value[0, 0] = np.nan
    kernel.assign(value)
    state.back_up(1)
    resume = state.roll_back()
    assert resume.epoch == 1
    for restored, saved in zip(weights_of(model), good, strict=True):
        np.testing.assert_array_equal(restored, saved)
    assert [c.sequence for c in state.checkpoints()] == [1]
    state.close()


def test_a_save_that_replaces_the_last_one_leaves_one_per_epoch(backup_dir, data):
    model = make_model()
    state = WorkerTrainingState(model, backup_dir, async_save=True)
    train_epochs(model, data, 0, 2, state)
    state.back_up(1, extra={"more": 1}, replaces_last=True)
    state.wait()
    checkpoints = state.checkpoints()
    assert len(checkpoints) == 2  # The epochs 1 and 2, not epoch 2 twice.
    resume = WorkerTrainingState(make_model(), backup_dir).restore()
    assert (resume.epoch, resume.extra["more"]) == (2, 1)
    older = WorkerTrainingState(make_model(), backup_dir)
    older.store.delete(checkpoints[-1])
    assert older.restore().epoch == 1


# A local tier (`local_dir`) in front of a bucket.


class CrashAt(keras.callbacks.Callback):
    """Raises at a batch end: a process that died there."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            raise RuntimeError("crash")


class BucketReads:
    """The objects of checkpoints read from a memory:// bucket."""

    def __init__(self, monkeypatch):
        import fsspec

        fs = fsspec.filesystem("memory")
        self.reads: list[str] = []
        opened, cat_file = fs._open, fs.cat_file

        def reading(path, mode="rb", *args, **kwargs):
            if "r" in mode and "/ckpt-" in path:
                self.reads.append(path)
            return opened(path, mode, *args, **kwargs)

        def cat(path, *args, **kwargs):
            if "/ckpt-" in path:
                self.reads.append(path)
            return cat_file(path, *args, **kwargs)

        monkeypatch.setattr(fs, "_open", reading)
        monkeypatch.setattr(fs, "cat_file", cat)


def fit_tiered(bucket, local_dir, data, *callbacks, epochs=3):
    """3 epochs of 8 batches: the bucket every epoch, the local tier every
    3 batches. Returns the model and where it resumed."""
    keras.utils.set_random_seed(3)
    model = make_model()
    backup = BackupAndRestore(
        bucket, local_dir=local_dir, local_save_freq=local_dir and 3,
        delete_checkpoint=False,
        verbose=0,
    )  # fmt: skip
    begun = []

    class Begun(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            begun.append(iterations(self.model))

    try:
        model.fit(*data, epochs=epochs, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[backup, Begun(), *callbacks])  # fmt: skip
    finally:
        keras_ft.wait_for_backups()
    return model, begun[0]


def bucket_url() -> str:
    return f"memory://tier-{os.getpid()}-{time.monotonic_ns()}"


def test_a_local_tier_restores_with_no_read_from_the_bucket(
    tmp_path, data, monkeypatch
):
    reference, _ = fit_tiered(bucket_url(), None, data)
    bucket, local = bucket_url(), str(tmp_path / "ssd")
    with pytest.raises(RuntimeError, match="crash"):
        fit_tiered(bucket, local, data, CrashAt(1, 7))
    reads = BucketReads(monkeypatch)
    model, begun = fit_tiered(bucket, local, data)
    # Epoch 2, batch 6: the local tier's save, two past the bucket's newest.
    assert begun == 8 + 6
    assert reads.reads == []
    for mine, theirs in zip(weights_of(model), weights_of(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    # Every epoch went to the bucket, each committed locally first.
    store = keras_ft.checkpoint.store.open_store(f"{bucket}/chief")
    assert [store.unverified_metadata(c)["step"] for c in store.checkpoints()] == [
        16, 24
    ]  # fmt: skip


def test_an_empty_or_older_local_tier_restores_from_the_bucket(tmp_path, data):
    bucket, local = bucket_url(), str(tmp_path / "ssd")
    with pytest.raises(RuntimeError, match="crash"):
        fit_tiered(bucket, local, data, CrashAt(1, 7))
    # A new machine: its local tier is empty.
    with pytest.raises(RuntimeError, match="crash"):
        fit_tiered(bucket, str(tmp_path / "new"), data, CrashAt(2, 2))
    # Back on the first machine: its tier (epoch 2, batch 6) is older than
    # the bucket's (epoch 2 ended, from the other machine).
    _, begun = fit_tiered(bucket, local, data)
    assert begun == 16


def test_a_damaged_local_checkpoint_falls_back_to_the_bucket(tmp_path, data):
    bucket, local = bucket_url(), str(tmp_path / "ssd")
    with pytest.raises(RuntimeError, match="crash"):
        fit_tiered(bucket, local, data, CrashAt(1, 7))
    (name,) = os.listdir(local)  # One backup's tier.
    tier = os.path.join(local, name)
    newest = sorted(n for n in os.listdir(tier) if n.startswith("ckpt-"))[-1]
    with open(os.path.join(tier, newest, "model.weights.h5"), "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.warns(
        UserWarning, match="local tier.s checkpoint ckpt-[0-9]+ is damaged"
    ):
        _, begun = fit_tiered(bucket, local, data)
    assert begun == 8  # The bucket's, epoch 1.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"local_dir": "LOCAL"}, "`backup_dir` is a directory already"),
        ({"backup_dir": "memory://x", "local_dir": "s3://y"}, "it is a URL"),
        ({"local_save_freq": 3}, "`local_dir` is None"),
        ({"backup_dir": "memory://x", "local_dir": "LOCAL", "local_save_freq": 0},
         "Expected 'epoch', a positive integer"),
    ],
)  # fmt: skip
def test_local_tier_arguments_are_checked(tmp_path, kwargs, match):
    kwargs = {"backup_dir": str(tmp_path / "backup"), **kwargs}
    if kwargs.get("local_dir") == "LOCAL":
        kwargs["local_dir"] = str(tmp_path / "ssd")
    with pytest.raises(ValueError, match=match):
        BackupAndRestore(**kwargs)


@pytest.mark.skipif(
    keras.backend.backend() == "jax", reason="JAX clusters agree through JAX"
)
def test_a_local_tier_in_a_cluster_without_collectives_is_refused_before_any_save(
    tmp_path,
):
    # TensorFlow without a MultiWorkerMirroredStrategy, PyTorch without an
    # initialised torch.distributed group: the processes cannot agree.
    state = WorkerTrainingState(
        make_model(), bucket_url(), task=TaskSpec("worker", 0, 2, True),
        local_dir=str(tmp_path / "ssd"),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"`local_dir`.*has none of them.*local_dir="):
        state.lock()
    assert not os.path.exists(tmp_path / "ssd")


def test_a_preemption_backs_up_to_the_local_tier_first(tmp_path, data):
    import signal

    committed = []

    class Commits(keras_ft.CheckpointListener):
        def after_commit(self, path, epoch, step):
            committed.append((path.startswith("memory://"), step))

    class Preempt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    bucket = bucket_url()
    backup = BackupAndRestore(
        bucket, local_dir=str(tmp_path / "ssd"), save_freq=False,
        exit_on_preemption=False, listeners=[Commits()], verbose=0,
    )  # fmt: skip
    make_model().fit(*data, epochs=2, batch_size=8, verbose=0,
                     callbacks=[backup, Preempt()])  # fmt: skip
    assert backup.preempted_by == "SIGTERM"
    # Committed to the local tier (its newest), then copied to the bucket.
    ((in_bucket, step),) = committed
    assert in_bucket and step >= 3
    (name,) = os.listdir(tmp_path / "ssd")
    tier = keras_ft.checkpoint.store.open_store(str(tmp_path / "ssd" / name))
    assert tier.unverified_metadata(tier.checkpoints()[-1])["step"] == step
    with open(os.path.join(tier.directory, "uploaded.json")) as f:
        assert json.load(f) == {"committed": {"sequence": 1, "position": [0, 4, step]}}


def test_check_extra_makes_a_checkpoint_whose_extra_it_refuses_damaged(
    backup_dir, data
):
    """A custom loop's own `extra`, checked before anything is restored: a
    checkpoint it refuses is damaged, and the restore falls back."""
    x, y = data
    model = make_model()
    state = WorkerTrainingState(model, backup_dir, keep=3)
    for epoch, schedule in enumerate(["cosine", ["not", "a", "name"]]):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        state.back_up(epoch, extra={"schedule": schedule})
    state.wait()

    def check(extra):
        if not isinstance(extra.get("schedule"), str):
            raise ValueError("schedule is not a name")

    fresh = make_model()
    with pytest.warns(UserWarning, match="ckpt-00000002.*schedule is not a name"):
        point = WorkerTrainingState(fresh, backup_dir, check_extra=check).restore()
    assert point.epoch == 1 and point.extra["schedule"] == "cosine"
    with pytest.raises(ValueError, match="`check_extra`.*Received: check_extra='x'"):
        WorkerTrainingState(make_model(), backup_dir, check_extra="x")


def test_unlock_returns_once_the_writes_in_flight_have_committed(
    backup_dir, monkeypatch
):
    """Nothing of a training commits once it let go of the directory, when
    another training may hold it."""
    write = keras_ft.saves.save.write_snapshot

    def slow_write(snapshot, directory):
        time.sleep(0.5)
        write(snapshot, directory)

    monkeypatch.setattr(keras_ft.saves.save, "write_snapshot", slow_write)
    state = WorkerTrainingState(make_model(), backup_dir, async_save=True)
    state.lock()
    assert state.back_up(1) is None  # Asynchronous: still being written.
    state.unlock()
    store = keras_ft.checkpoint.store.CheckpointStore(os.path.join(backup_dir, "chief"))
    assert [c.name for c in store.checkpoints()] == ["ckpt-00000001"]
    assert not state.writing
