"""Sharded saves: each process writes its pieces, the chief commits, any layout
restores.

The format's own tests write pieces as several processes would and read them
back through `ShardedReader`. The cluster tests run real JAX processes on
127.0.0.1 under `keras.distribution.ModelParallel` (kernels split across the
devices of every process), through `examples/model_parallel_cluster.py`;
they do not depend on the backend running the suite, so they run once, with
the JAX suite.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from conftest import (
    BUCKET,
    TESTS_DIR,
    checkpoint_entries,
    free_ports,
    iterations,
    make_data,
    make_model,
    subprocess_env,
)

import keras_ft
from keras_ft.checkpoint.parts import LocalParts, remove_local_parts
from keras_ft.checkpoint.store import CheckpointStore, open_store
from keras_ft.distribute import sharded
from keras_ft.errors import (
    CorruptCheckpointError,
    ProcessesDisagreeError,
    SaveCancelled,
)
from keras_ft.state import TrainingState, arrays

HARNESS = os.path.join(
    os.path.dirname(TESTS_DIR), "examples", "model_parallel_cluster.py"
)

JAX_CLUSTER = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX processes, whatever the suite's backend: run once, with JAX",
)

# Format: two "processes" each holding half of a (6, 8) kernel's columns;
# process 0 also holds a scalar, as replica 0 of a replicated variable.
KERNEL = np.arange(48, dtype=np.float32).reshape(6, 8)
SPECS = [["model", "dense/kernel", [6, 8], "float32"], ["optimizer", "it", [], "int64"]]


def pieces_of(process: int) -> sharded.Share:
    columns = slice(4 * process, 4 * process + 4)
    found = [(0, (0, columns.start), (6, columns.stop), KERNEL[:, columns])]
    if process == 0:
        found.append((1, (), (), np.array(7, np.int64)))
    return sharded.Share.copy_of(found)


def commit(store: CheckpointStore, tag: str, processes=(0, 1), total: int = 2):
    parts = store.storage.parts(tag, 0)  # On a disk, named by the save.
    for process in processes:
        sharded.write_part(parts, process, tag, pieces_of(process))

    def write(staging):
        sharded.commit_parts(staging, parts, total, tag, SPECS, ["cols", ""])

    return store.save(write, {"step": 1})


def test_pieces_of_two_processes_commit_and_any_slice_reads_back(tmp_path):
    store = CheckpointStore(str(tmp_path / "chief"))
    checkpoint = commit(store, "00000001-000000000001")
    assert sorted(os.listdir(checkpoint.path)) == [
        "manifest.json", "metadata.json", "shards-00000.bin", "shards-00001.bin",
        "shards.json",
    ]  # fmt: skip
    store.verify(checkpoint)  # Whole files, as `keras-ft verify` checks them.
    reader = sharded.ShardedReader(checkpoint.path, SPECS)
    # A slice across both processes' pieces, one inside one, the whole.
    np.testing.assert_array_equal(reader.read(0, ((1, 2), (5, 7))), KERNEL[1:5, 2:7])
    np.testing.assert_array_equal(reader.read(0, ((0, 5), (6, 8))), KERNEL[:, 5:])
    np.testing.assert_array_equal(reader.read(0, ((0, 0), (6, 8))), KERNEL)
    assert reader.read(1, ((), ())) == 7
    reader.close()
    with open(os.path.join(checkpoint.path, "shards.json")) as f:
        table = json.load(f)
    assert table["processes"] == 2
    assert [len(v["pieces"]) for v in table["variables"]] == [2, 1]
    assert table["variables"][0]["shape"] == [6, 8]
    # The parts directory went into the checkpoint.
    assert not [n for n in os.listdir(store.directory) if n.startswith(".parts-")]


def test_a_table_says_which_slice_its_pieces_do_not_cover(tmp_path):
    """A local tier holds one process's pieces, of the layout it saved in:
    a restore into another layout finds out from the table, before any
    collective read."""
    both = commit(CheckpointStore(str(tmp_path / "both")), "00000001-000000000001")
    one = commit(CheckpointStore(str(tmp_path / "one")), "00000001-000000000001")
    # As a tier of process 0 holds it: its own pieces only.
    path = os.path.join(one.path, "shards.json")
    with open(path) as f:
        table = json.load(f)
    for variable in table["variables"]:
        variable["pieces"] = [
            p for p in variable["pieces"] if p["file"] == "shards-00000.bin"
        ]
    with open(path, "w") as f:
        json.dump(table, f)
    whole = [[((0, 0), (6, 8))], [((), ())]]
    left = [[((0, 0), (6, 4))], [((), ())]]
    assert sharded.ShardedReader(both.path, SPECS).missing(whole) is None
    assert sharded.ShardedReader(one.path, SPECS).missing(left) is None
    assert sharded.ShardedReader(one.path, SPECS).missing(whole) == (
        "'dense/kernel' [[0, 0]:[6, 8]]"
    )
    # Another split of the same columns: covered by the pieces together.
    assert sharded.ShardedReader(both.path, SPECS).missing(
        [[((0, 2), (6, 6)), ((0, 6), (6, 8))], []]
    ) is None  # fmt: skip


def test_a_damaged_piece_is_caught_by_whoever_reads_it(tmp_path):
    store = CheckpointStore(str(tmp_path / "chief"))
    checkpoint = commit(store, "00000001-000000000001")
    path = os.path.join(checkpoint.path, "shards-00001.bin")
    with open(path, "r+b") as f:
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 0xFF]))
    # A restore checks the small files whole and each piece it reads.
    store.verify(checkpoint, whole=False)
    reader = sharded.ShardedReader(checkpoint.path, SPECS)
    np.testing.assert_array_equal(reader.read(0, ((0, 0), (6, 4))), KERNEL[:, :4])
    with pytest.raises(CorruptCheckpointError, match="shards-00001.bin.*checksum"):
        reader.read(0, ((0, 3), (6, 6)))
    reader.close()
    with pytest.raises(CorruptCheckpointError, match="shards-00001.bin"):
        store.verify(checkpoint)  # `keras-ft verify` checks whole files.


def test_a_process_missing_from_a_save_commits_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(sharded.WAIT_ENV, "1")
    store = CheckpointStore(str(tmp_path / "chief"))
    first = commit(store, "00000001-000000000001")
    with pytest.raises(ProcessesDisagreeError, match=r"Processes \[1\] did not write"):
        commit(store, "00000002-000000000002", processes=(0,))
    assert store.checkpoints() == [first]
    # Pieces that do not cover a variable: not committed either.
    parts = store.storage.parts("00000003-000000000003", 0)
    sharded.write_part(parts, 0, "00000003-000000000003", pieces_of(0))

    def write(staging):
        sharded.commit_parts(
            staging, parts, 1, "00000003-000000000003", SPECS, ["", ""]
        )

    with pytest.raises(ProcessesDisagreeError, match="cover 24 of its 48 values"):
        store.save(write, {})
    assert store.checkpoints() == [first]
    remove_local_parts(store.directory)
    assert not [n for n in os.listdir(store.directory) if n.startswith(".parts-")]


def upload(store, tag: str, processes=(0, 1), total: int = 2):
    """`commit()` into a bucket: each process uploads its part into the
    checkpoint's number, the chief's commit lists them in place."""
    parts = store.storage.parts(tag, store.storage.next_sequence())
    for process in processes:
        sharded.write_part(parts, process, tag, pieces_of(process))

    def write(staging):
        sharded.commit_parts(staging, parts, total, tag, SPECS, ["cols", ""])

    return store.save(write, {"step": 1})


class RangeLog:
    """Each byte range read from the bucket, and each object downloaded whole."""

    def __init__(self, fs, monkeypatch):
        self.ranges, self.whole = [], []
        cat_file, get_file = fs.cat_file, fs.get_file

        def ranged(path, start=None, end=None, **kwargs):
            self.ranges.append((path.rsplit("/", 1)[-1], start, end))
            return cat_file(path, start=start, end=end, **kwargs)

        def downloaded(rpath, lpath, **kwargs):
            self.whole.append(rpath.rsplit("/", 1)[-1])
            return get_file(rpath, lpath, **kwargs)

        monkeypatch.setattr(fs, "cat_file", ranged)
        monkeypatch.setattr(fs, "get_file", downloaded)


def test_pieces_uploaded_to_a_bucket_commit_and_a_restore_fetches_what_it_reads(
    monkeypatch,
):
    store = open_store(f"memory://sharded-{os.getpid()}-{time.monotonic_ns()}/chief")
    checkpoint = upload(store, "00000001-000000000001")
    assert store.storage.reader.names(checkpoint) == {
        "manifest.json", "metadata.json", "shards-00000.bin", "shards-00000.json",
        "shards-00001.bin", "shards-00001.json", "shards.json",
    }  # fmt: skip
    store.verify(checkpoint)  # Whole objects, as `keras-ft verify` checks them.
    log = RangeLog(store.storage.fs, monkeypatch)

    def read(local, progress):
        reader = sharded.ShardedReader(local.path, SPECS, local.ranges)
        try:
            # Fetched ahead, in parallel: the pieces these slices overlap,
            # before anything is read.
            reader.read_ahead([[((0, 0), (6, 4))], [((), ())]])
            deadline = time.monotonic() + 10
            while not log.ranges and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(log.ranges) == 1, log.ranges
            return reader.read(0, ((0, 0), (6, 4))), reader.read(1, ((), ()))
        finally:
            reader.close()

    local, _, (kernel, scalar) = store.fetch(checkpoint, read)
    store.release(local)
    np.testing.assert_array_equal(kernel, KERNEL[:, :4])
    assert scalar == 7
    # The two pieces read (bytes 0-96 and 128-136 of the first process's
    # file: 32 bytes of alignment between them) in one ranged GET; nothing
    # of the other process's file; no piece file downloaded whole.
    assert log.ranges == [("shards-00000.bin", 0, 136)]
    assert not [n for n in log.whole if n.endswith(".bin")]
    assert "shards.json" in log.whole


def test_pieces_close_together_in_a_file_are_fetched_in_runs():
    gap, most = sharded._RUN_GAP, sharded._RUN_BYTES
    a, b = "shards-00000.bin", "shards-00001.bin"
    runs = sharded._runs([
        (b, 0, 64),  # Needed first: its run comes first.
        (a, 0, 96), (a, 128, 8),  # 32 bytes apart: one run.
        (a, 136 + gap + 1, 8),  # Further than the gap: a run of its own.
        (a, 100_000_000, most - 8), (a, 100_000_000 + most - 8, 16),  # Too long.
        (a, 136 + gap + 5, 8),  # Overlaps the one before (a forged table).
    ])  # fmt: skip
    assert [(r.name, r.offset, r.nbytes, len(r.pieces)) for r in runs] == [
        (b, 0, 64, 1),
        (a, 0, 136, 2),
        (a, 136 + gap + 1, 8, 1),
        (a, 100_000_000, most - 8, 1),
        (a, 100_000_000 + most - 8, 16, 1),
        (a, 136 + gap + 5, 8, 1),
    ]
    assert runs[1].pieces == [(a, 0, 96), (a, 128, 8)]


def read_kernel(local) -> np.ndarray:
    """The first variable whole (both processes' pieces), read from the
    fetched checkpoint `local` as a restore reads it."""
    reader = sharded.ShardedReader(local.path, SPECS, local.ranges)
    try:
        reader.read_ahead([[((0, 0), (6, 8))], []])
        return reader.read(0, ((0, 0), (6, 8)))
    finally:
        reader.close()


def test_a_damaged_piece_in_a_bucket_is_caught_by_whoever_reads_it():
    store = open_store(f"memory://sharded-{os.getpid()}-{time.monotonic_ns()}/chief")
    checkpoint = upload(store, "00000001-000000000001")
    key = f"{store.storage.root}/{checkpoint.name}/shards-00001.bin"
    data = bytearray(store.storage.fs.cat_file(key))
    data[8] ^= 0xFF
    store.storage.fs.pipe_file(key, bytes(data))

    with pytest.raises(CorruptCheckpointError, match="shards-00001.bin.*checksum"):
        store.fetch(checkpoint, lambda local, progress: read_kernel(local))
    with pytest.raises(CorruptCheckpointError, match="shards-00001.bin"):
        store.verify(checkpoint)  # `keras-ft verify` checks whole objects.


def test_a_piece_at_a_negative_offset_is_refused_without_a_get(monkeypatch):
    store = open_store(f"memory://sharded-{os.getpid()}-{time.monotonic_ns()}/chief")
    checkpoint = upload(store, "00000001-000000000001")
    log = RangeLog(store.storage.fs, monkeypatch)

    def read(local, progress):
        # A forged table (as if resealed): the second process's piece at -8.
        path = os.path.join(local.path, sharded.SHARDS_TABLE)
        with open(path) as f:
            table = json.load(f)
        for piece in table["variables"][0]["pieces"]:
            if piece["file"] == "shards-00001.bin":
                piece["offset"] = -8
        with open(path, "w") as f:
            json.dump(table, f)
        return read_kernel(local)

    # Refused (the forged table also fails its checksum in the manifest).
    with pytest.raises(CorruptCheckpointError):
        store.fetch(checkpoint, read)
    assert [r for r in log.ranges if r[0] == "shards-00001.bin"] == []


def test_a_malformed_index_on_a_disk_is_refused_as_in_a_bucket(tmp_path):
    """The same commit reads both storages' parts: an index naming another
    file, or one without its entry, commits nothing on a disk either, and
    the save's parts directory is gone."""
    store = CheckpointStore(str(tmp_path / "chief"))
    first = commit(store, "00000001-000000000001")
    for index in (
        {"tag": "t", "process": 0, "file": "../elsewhere.bin", "entry": {}},
        {"tag": "t", "process": 0, "file": "shards-00000.bin"},
    ):
        parts = store.storage.parts("t", 0)
        parts.write_index("shards-00000.json", json.dumps(index).encode())
        with pytest.raises(ProcessesDisagreeError, match="names|malformed"):
            store.save(
                lambda staging, parts=parts: sharded.commit_parts(
                    staging, parts, 1, "t", SPECS, ["", ""]
                ),
                {},
            )
        assert not os.path.exists(parts.where)
    assert store.checkpoints() == [first] and store.leftovers() == []


def test_a_process_missing_from_a_save_into_a_bucket_commits_nothing(monkeypatch):
    monkeypatch.setenv(sharded.WAIT_ENV, "1")
    store = open_store(f"memory://sharded-{os.getpid()}-{time.monotonic_ns()}/chief")
    first = upload(store, "00000001-000000000001")
    with pytest.raises(ProcessesDisagreeError, match=r"Processes \[1\] did not write"):
        upload(store, "00000002-000000000002", processes=(0,))
    assert store.checkpoints() == [first]
    assert store.leftovers() == []  # The partial upload was removed.
    # A process's part of another save under the same number: refused.
    sequence = store.storage.next_sequence()
    sharded.write_part(store.storage.parts("other", sequence), 1, "other", pieces_of(1))
    with pytest.raises(ProcessesDisagreeError, match="belongs to another save"):
        store.save(
            lambda staging: sharded.commit_parts(
                staging,
                store.storage.parts("mine", sequence),
                2,
                "mine",
                SPECS,
                ["", ""],
            ),
            {},
        )
    # An index without its entry or pieces: refused, and nothing is left.
    sequence = store.storage.next_sequence()
    index = {"tag": "mine", "process": 0, "file": "shards-00000.bin"}
    store.storage.fs.pipe_file(
        f"{store.storage.root}/ckpt-{sequence:08d}/shards-00000.json",
        json.dumps(index).encode(),
    )
    with pytest.raises(ProcessesDisagreeError, match="malformed"):
        store.save(
            lambda staging: sharded.commit_parts(
                staging,
                store.storage.parts("mine", sequence),
                1,
                "mine",
                SPECS,
                [""],
            ),
            {},
        )
    assert store.checkpoints() == [first] and store.leftovers() == []


def test_a_share_is_one_aligned_image_reused_by_the_next_copy():
    first = pieces_of(0)
    assert [p.offset for p in first.pieces] == [0, 128]  # 64-byte aligned.
    assert first.size == 128 + 8
    image = np.frombuffer(first.image(), np.uint8)
    np.testing.assert_array_equal(image[:96].view(np.float32), KERNEL[:, :4].ravel())
    # The next save's copy goes into the same memory, the new values in it.
    changed = [(0, (0, 0), (6, 4), KERNEL[:, :4] + 1), (1, (), (), np.array(8))]
    second = sharded.Share.copy_of(changed, reuse=first)
    assert second is first
    np.testing.assert_array_equal(second.pieces[0].data, KERNEL[:, :4] + 1)
    # Another layout gets its own.
    other = [(0, (0, 0), (3, 8), KERNEL[:3])]
    assert sharded.Share.copy_of(other, reuse=first) is not first


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's shards")
def test_a_share_moved_from_device_copies_holds_what_a_copy_holds(monkeypatch):
    """A sharded save that snapshots on the device moves each piece straight
    into the share's buffer (in pieces, as from an accelerator, here on the
    CPU), lets each device copy go, and reuses the buffer the next time."""
    import jax.numpy as jnp

    from keras_ft.backend import device_memory

    monkeypatch.setattr(device_memory, "_read_in_place", lambda array: False)
    monkeypatch.setattr(device_memory, "_MOVE_PIECE", 1000)
    rng = np.random.default_rng(0)
    values = [
        jnp.asarray(rng.normal(size=(37, 29)).astype("float32")),
        jnp.asarray(rng.normal(size=(601,))).astype("bfloat16"),
        jnp.asarray(7, "int32"),
    ]
    copied = sharded.take_share(values)
    copies, _ = device_memory.device_snapshot(values)
    moved = sharded.move_share(copies)
    assert copies == [None] * len(values)
    assert moved.layout == copied.layout
    for mine, theirs in zip(moved.pieces, copied.pieces, strict=True):
        assert mine.data.dtype == theirs.data.dtype
        np.testing.assert_array_equal(mine.data, theirs.data)
    doubled = [v * 2 for v in values]
    again = sharded.move_share(device_memory.device_snapshot(doubled)[0], reuse=moved)
    assert again is moved
    for piece, value in zip(again.pieces, doubled, strict=True):
        np.testing.assert_array_equal(piece.data, np.asarray(value))


def test_waiting_for_parts_can_be_called_off_and_refuses_another_saves_part(
    tmp_path,
):
    parts = LocalParts(str(tmp_path), "a")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(SaveCancelled):
        sharded.wait_for_parts(parts, 2, "a", cancel)
    sharded.write_part(parts, 0, "b", pieces_of(0))
    with pytest.raises(ProcessesDisagreeError, match="belongs to another save"):
        sharded.wait_for_parts(parts, 1, "a")


def test_a_sharded_checkpoint_loads_into_one_process_on_any_backend(tmp_path):
    # A checkpoint as two processes of a model-parallel run would write it:
    # every variable's rows split between them; loaded into a plain model.
    model = make_model(units=6)
    model.fit(*make_data(), epochs=1, batch_size=16, verbose=0)
    state = TrainingState(model)
    snapshot = state.snapshot(1, 0)
    snapshot.release()  # Its metadata and arrays only: the weights go in shards.
    values = [keras.ops.convert_to_numpy(v) for v in state.saved_variables()]
    parts = {0: [], 1: []}
    for i, value in enumerate(values):
        if value.ndim == 0:  # A scalar (the step count): process 0's.
            parts[0].append((i, (), (), value))
            continue
        half = value.shape[0] // 2
        for process, (low, high) in enumerate([(0, half), (half, value.shape[0])]):
            if high > low:
                start = (low,) + (0,) * (value.ndim - 1)
                stop = (high, *value.shape[1:])
                parts[process].append((i, start, stop, value[low:high]))
    store = CheckpointStore(str(tmp_path / "backup" / "chief"))
    tag = "00000001-000000000008"
    place = store.storage.parts(tag, 0)
    for process, found in parts.items():
        sharded.write_part(place, process, tag, sharded.Share.copy_of(found))
    specs = state.variable_specs()

    def write(staging):
        sharded.commit_parts(staging, place, 2, tag, specs, [""] * len(specs))
        staging.write_file(arrays.ARRAYS_FILE, [arrays.to_bytes(snapshot.arrays)])

    store.save(write, snapshot.metadata)
    fresh = make_model(units=6)
    loaded = keras_ft.load_checkpoint(str(tmp_path / "backup"), fresh)
    assert loaded.step == iterations(model) == iterations(fresh)
    for mine, theirs in zip(values, state.saved_variables(), strict=True):
        np.testing.assert_array_equal(mine, keras.ops.convert_to_numpy(theirs))
    fresh_values = TrainingState(fresh).saved_variables()
    for mine, theirs in zip(values, fresh_values, strict=True):
        np.testing.assert_array_equal(mine, keras.ops.convert_to_numpy(theirs))


# Real clusters.


def run(backup_dir: str, *args: str, timeout: float = 300) -> dict:
    result = subprocess.run(
        [sys.executable, HARNESS, "--backup-dir", backup_dir, "--json", "--quiet",
         *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    outcome = json.loads(line[len("RESULT ") :])
    assert set(outcome["exit_codes"]) == {0}, result.stdout[-3000:]
    return outcome


def one(values: list) -> object:
    """The value every process reported (they must agree)."""
    assert len(set(values)) == 1, values
    return values[0]


@JAX_CLUSTER
def test_a_killed_process_resumes_with_the_weights_of_an_uninterrupted_run(tmp_path):
    """The killed run's saves snapshot on the device, as "auto" does on a
    GPU: each process's pieces move to host memory only after the steps
    that follow a save have run (Keras donated the variables to them)."""
    common = ["--processes", "2", "--devices", "2", "--epochs", "3",
              "--save-freq", "3", "--seconds-per-batch", "0.05"]  # fmt: skip
    reference = run(str(tmp_path / "reference"), *common)
    backup_dir = str(tmp_path / "backup")
    killed = run(backup_dir, *common, "--kill-after-commit", "--seed", "2",
                 "--snapshot", "device", "--hold-moves", "0.2")  # fmt: skip
    victim = killed["victim"]
    assert killed["exit_codes_after_kill"][str(victim)] == -9  # SIGKILL, for real.
    resumed = one(killed["resumed_steps"])
    assert 0 < resumed <= killed["killed_after_step"] and resumed % 3 == 0
    assert one(killed["final_steps"]) == one(reference["final_steps"]) == 24
    assert one(killed["final_digests"]) == one(reference["final_digests"])
    # Both processes wrote their own file of every checkpoint kept.
    store = CheckpointStore(os.path.join(backup_dir, "chief"))
    for checkpoint in store.checkpoints():
        store.verify(checkpoint)
        names = sorted(os.listdir(checkpoint.path))
        assert [n for n in names if n.startswith("shards-")] == [
            "shards-00000.bin", "shards-00001.bin"
        ]  # fmt: skip
    kept = [n for n in os.listdir(store.directory) if not n.startswith("goodput_")]
    assert sorted(kept) == [".lock", *[c.name for c in store.checkpoints()]]


@JAX_CLUSTER
@pytest.mark.parametrize("snapshot", ["device", "host"])
def test_a_piece_not_finite_in_one_process_keeps_every_process_from_saving(
    tmp_path, snapshot
):
    """At step 6 the last process's piece of a kernel turns NaN (the other
    process's pieces stay finite): the save of that step is refused by both
    processes together, whichever way they copy, and the backup of step 3
    stays the newest."""
    backup_dir = str(tmp_path / "backup")
    outcome = run(backup_dir, "--processes", "2", "--devices", "2", "--epochs", "2",
                  "--save-freq", "3", "--poison-at-step", "6",
                  "--snapshot", snapshot)  # fmt: skip
    assert outcome["final_steps"] == [16, 16]  # Neither waited for the other.
    chief, holder = outcome["first_non_finite"]
    where = "hold NaN or infinity at epoch 1, batch 6; not backing up"
    assert f"another process's pieces {where}" in chief
    assert f"hidden_1/kernel {where}" in holder
    store = CheckpointStore(os.path.join(backup_dir, "chief"))
    [checkpoint] = store.checkpoints()
    store.verify(checkpoint)
    with open(checkpoint.file("metadata.json")) as f:
        assert json.load(f)["step"] == 3


@JAX_CLUSTER
def test_four_processes_backup_restores_into_two_into_one_and_back(tmp_path):
    backup_dir = str(tmp_path / "backup")
    # 4 processes, one device each; every save measured.
    four = run(backup_dir, "--processes", "4", "--epochs", "1", "--save-freq", "4",
               "--units", "2048", "--measure-memory")  # fmt: skip
    shares = four["shares"]
    total = sum(shares)
    assert len(shares) == 4 and min(shares) > 0.24 * total
    # Each process's extra host memory during a save is its share (a little
    # less where the save reuses pages the step before freed).
    for peak, share in zip(four["save_peaks"], shares, strict=True):
        assert 0.9 * share <= peak <= 1.2 * share, (peak, share)
    # Into 2 processes of 2 devices: another mesh, each reads half.
    two = run(backup_dir, "--processes", "2", "--devices", "2", "--epochs", "2",
              "--units", "2048")  # fmt: skip
    assert one(two["resumed_steps"]) == 8
    assert one(two["restored_digests"]) == one(four["final_digests"])
    assert len(two["shares"]) == 2
    # Into one process (4 devices): written whole, as on one host.
    single = run(backup_dir, "--processes", "1", "--devices", "4", "--epochs", "3",
                 "--units", "2048")  # fmt: skip
    assert one(single["restored_digests"]) == one(two["final_digests"])
    assert single["shares"] is None
    # And back into 4 processes.
    again = run(backup_dir, "--processes", "4", "--epochs", "4", "--units", "2048")
    assert one(again["resumed_steps"]) == 24
    assert one(again["restored_digests"]) == one(single["final_digests"])
    assert one(again["final_steps"]) == 32


@JAX_CLUSTER
def test_processes_that_find_different_newest_checkpoints_stop_saying_so(tmp_path):
    first = str(tmp_path / "first")
    run(first, "--processes", "2", "--epochs", "1", "--save-freq", "4")
    # Process 1 sees the backup without its newest checkpoint (as if started
    # before the last commit of the run before).
    second = str(tmp_path / "second")
    shutil.copytree(first, second)
    newest = [n for n in checkpoint_entries(second) if n.startswith("ckpt-")][-1]
    shutil.rmtree(os.path.join(second, "chief", newest))
    port = str(free_ports(1)[0])
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                HARNESS,
                "--worker",
                str(i),
                "--processes",
                "2",
                "--epochs",
                "2",
                "--backup-dir",
                directory,
                "--port",
                port,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )  # fmt: skip
        for i, directory in enumerate([first, second])
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=300)
        assert worker.returncode != 0
        assert "found different newest checkpoints" in stderr, stderr[-2000:]


# In a bucket (the local S3 server): no filesystem the processes share.


def bucket_url(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{os.getpid()}-{time.monotonic_ns()}"


# Two processes of two devices each; a save to the bucket every 3 batches.
COMMON = ("--processes", "2", "--devices", "2", "--epochs", "3",
          "--save-freq", "3", "--seconds-per-batch", "0.05")  # fmt: skip


@functools.cache
def reference_run() -> dict:
    """An uninterrupted run of `COMMON` into the bucket, once per module."""
    return run(bucket_url("reference"), *COMMON)


@JAX_CLUSTER
def test_a_process_killed_while_uploading_resumes_from_the_bucket_exactly(s3_server):
    reference = reference_run()
    backup = bucket_url("killed")
    killed = run(backup, *COMMON, "--kill-after-commit", "--seed", "2")
    assert killed["exit_codes_after_kill"][str(killed["victim"])] == -9
    resumed = one(killed["resumed_steps"])
    assert 0 < resumed <= killed["killed_after_step"] and resumed % 3 == 0
    assert one(killed["final_steps"]) == one(reference["final_steps"]) == 24
    assert one(killed["final_digests"]) == one(reference["final_digests"])
    # Each process uploaded its own pieces of every checkpoint kept; what
    # the killed run left uncommitted was removed by the relaunch.
    store = open_store(f"{backup}/chief")
    assert store.checkpoints() and store.leftovers() == []
    for checkpoint in store.checkpoints():
        store.verify(checkpoint)
        assert {"shards-00000.bin", "shards-00001.bin"} <= (
            store.storage.reader.names(checkpoint)
        )


@JAX_CLUSTER
def test_processes_back_up_to_a_bucket_and_restore_into_fewer(s3_server):
    """Each process uploads its own pieces; one process then reads all of
    them by ranges. (Four processes into two and one, and back: on a disk,
    `test_four_processes_backup_restores_into_two_into_one_and_back`; the
    bucket's part, the pieces' upload and ranged reads, is the same for any
    number of processes.)"""
    backup = bucket_url("reshard")
    two = run(backup, "--processes", "2", "--devices", "2", "--epochs", "1",
              "--save-freq", "4", "--units", "256")  # fmt: skip
    assert len(two["shares"]) == 2 and min(two["shares"]) > 0
    single = run(backup, "--processes", "1", "--devices", "4", "--epochs", "2",
                 "--units", "256")  # fmt: skip
    assert one(single["resumed_steps"]) == 8
    assert one(single["restored_digests"]) == one(two["final_digests"])
    assert single["shares"] is None  # One process writes whole arrays.


@JAX_CLUSTER
def test_model_parallel_processes_resume_from_their_local_tiers(s3_server, tmp_path):
    """Each process keeps its own pieces (every piece it holds) on its
    "own" disk every batch. Killed after a bucket commit, they resume from
    their tiers (at least as far as the bucket's newest; a tie goes to the
    tier), reading no checkpoint object from the bucket (the server's
    request log says), bitwise as an uninterrupted run. (A wiped tier:
    `test_remote.py`, the same agreement.)"""
    local = str(tmp_path / "local")
    # Snapshots on the device: one move to host memory feeds both commits.
    killed = run(bucket_url("tiers"), *COMMON, "--kill-after-commit", "--seed", "0",
                 "--local-dir", local, "--count-bucket-reads",
                 "--snapshot", "device", "--hold-moves", "0.1")  # fmt: skip
    assert killed["exit_codes_after_kill"][str(killed["victim"])] == -9
    resumed = one(killed["resumed_steps"])
    assert killed["bucket_step"] <= resumed <= killed["killed_after_step"] + 1
    assert killed["bucket_reads_after_relaunch"] == 0, killed
    assert one(killed["final_digests"]) == one(reference_run()["final_digests"])
