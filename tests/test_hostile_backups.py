"""A backup is untrusted input: hostile backups, built here, through every
way keras-ft reads one (the restore, `watch()`, `keras-ft ls / verify /
export / prune`).

Each case alters the newest of three real checkpoints. Whatever it does,
keras-ft must not read or change anything outside the backup directory (an
`outside/` directory beside it, whose files' access times are watched), must
end in bounded time and memory, and must fall back to the checkpoint before
or fail with a clear error.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import threading
import time
import warnings

import h5py
import keras
import numpy as np
import pytest
from conftest import make_data, make_model, run_once_on

import keras_ft
from keras_ft import cli
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.format import MANIFEST_FILE, manifest_body

ONCE = run_once_on("torch", "files and processes; the backend does not matter")
SECRET = b"the contents of a file outside the backup " * 64
MEMORY_BOUND = 512 << 20  # Bytes a case may add to the process's peak.


def bounded(action, seconds: float = 60.0):
    """`action()`, failing the test if it has not ended in `seconds` (a
    read blocked on a FIFO, say) or raised past the bound."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = action()
        except BaseException as e:  # Handed to the test.
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def reseal(checkpoint: str, key: bytes | None = None) -> None:
    """Writes a valid manifest for the listed files as they are now: what a
    writer who knows the format (but not a manifest key) can do."""
    with open(os.path.join(checkpoint, MANIFEST_FILE)) as f:
        listed = json.load(f)["files"]
    files = {
        name: file_io.entry(os.path.join(checkpoint, name))
        for name in listed
        if os.path.isfile(os.path.join(checkpoint, name))
    }
    with open(os.path.join(checkpoint, MANIFEST_FILE), "wb") as f:
        f.write(json.dumps(manifest_body(files, time.time(), key)).encode())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A real backup of three checkpoints."""
    root = tmp_path_factory.mktemp("pristine")
    x, y = make_data()
    model = make_model()
    state = keras_ft.WorkerTrainingState(model, str(root / "backup"), keep=3)
    for epoch in range(3):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        state.back_up(epoch)
    state.wait()
    return str(root / "backup")


@pytest.fixture
def world(pristine, tmp_path):
    """`(backup, newest checkpoint, outside)`: a fresh copy of the backup and
    a directory outside it whose files' access times are set in the past,
    so that a read of one moves it (relatime)."""
    backup = str(tmp_path / "backup")
    shutil.copytree(pristine, backup)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    with h5py.File(outside / "secret.h5", "w") as f:
        f["vars/0"] = np.full((8,), 7.0, "float32")
    for name in os.listdir(outside):
        os.utime(outside / name, (0, time.time()))
    newest = os.path.join(backup, "chief", "ckpt-00000003")
    return backup, newest, str(outside)


def outside_state(outside: str) -> dict[str, tuple]:
    found = {}
    for root, _, names in os.walk(outside):
        for name in names:
            path = os.path.join(root, name)
            status = os.lstat(path)
            with open(path, "rb") as f:
                found[path] = (f.read(), status.st_mtime_ns, status.st_atime_ns)
            # This look was a read too: put the access time back.
            os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    return found


def atime_tells_reads(directory: str) -> bool:
    probe = os.path.join(directory, ".probe")
    with open(probe, "wb") as f:
        f.write(b"x")
    os.utime(probe, (0, time.time()))
    with open(probe, "rb") as f:
        f.read()
    moved = os.stat(probe).st_atime_ns != 0
    os.remove(probe)
    return moved


# The hostile changes, each to the newest checkpoint (or the chief directory),
# with what a reader should name when it skips it.


def symlinked_manifest(newest, outside):
    os.remove(os.path.join(newest, MANIFEST_FILE))
    os.symlink(os.path.join(outside, "secret"), os.path.join(newest, MANIFEST_FILE))


def symlinked_weights(newest, outside):
    path = os.path.join(newest, "model.weights.h5")
    os.remove(path)
    os.symlink(os.path.join(outside, "secret.h5"), path)
    reseal_through_link(newest, "model.weights.h5", outside, "secret.h5")


def reseal_through_link(newest, name, outside, target):
    """A manifest whose entry for `name` matches the link's target."""
    with open(os.path.join(newest, MANIFEST_FILE)) as f:
        listed = json.load(f)["files"]
    files = {}
    for listed_name in listed:
        path = os.path.join(newest, listed_name)
        if listed_name == name:
            path = os.path.join(outside, target)
        files[listed_name] = file_io.entry(path)
    with open(os.path.join(newest, MANIFEST_FILE), "wb") as f:
        f.write(json.dumps(manifest_body(files, time.time())).encode())
    os.utime(os.path.join(outside, target), (0, time.time()))


def fifo_manifest(newest, outside):
    os.remove(os.path.join(newest, MANIFEST_FILE))
    os.mkfifo(os.path.join(newest, MANIFEST_FILE))


def fifo_weights(newest, outside):
    os.remove(os.path.join(newest, "model.weights.h5"))
    os.mkfifo(os.path.join(newest, "model.weights.h5"))


def dev_zero_metadata(newest, outside):
    os.remove(os.path.join(newest, "metadata.json"))
    os.symlink("/dev/zero", os.path.join(newest, "metadata.json"))


def sparse_metadata(newest, outside):
    with open(os.path.join(newest, "metadata.json"), "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, stored in a few blocks.


def sparse_metadata_resealed(newest, outside):
    sparse_metadata(newest, outside)
    with open(os.path.join(newest, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    manifest["files"]["metadata.json"]["size"] = 8 << 30  # Checksum unchanged.
    body = {k: v for k, v in manifest.items() if k != "digest"}
    with open(os.path.join(newest, MANIFEST_FILE), "wb") as f:
        f.write(json.dumps(manifest_body(body["files"], time.time())).encode())


def deep_manifest(newest, outside):
    with open(os.path.join(newest, MANIFEST_FILE), "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)


def huge_manifest(newest, outside):
    with open(os.path.join(newest, MANIFEST_FILE), "w") as f:
        f.write('{"pad": "' + "x" * (65 << 20) + '"}')


def manifest_is_a_directory(newest, outside):
    os.remove(os.path.join(newest, MANIFEST_FILE))
    os.mkdir(os.path.join(newest, MANIFEST_FILE))


def external_link_arrays(newest, outside):
    path = os.path.join(newest, "arrays.h5")
    with h5py.File(path, "a") as f:
        f["stolen"] = h5py.ExternalLink(os.path.join(outside, "secret.h5"), "vars/0")
    reseal(newest)


def external_raw_arrays(newest, outside):
    path = os.path.join(newest, "arrays.h5")
    with h5py.File(path, "a") as f:
        f.create_dataset(
            "stolen", (len(SECRET),), "uint8",
            external=[(os.path.join(outside, "secret"), 0, len(SECRET))],
        )  # fmt: skip
    reseal(newest)


def compressed_bomb_arrays(newest, outside):
    path = os.path.join(newest, "arrays.h5")
    with h5py.File(path, "a") as f:
        f.create_dataset(
            "bomb", (3 << 30,), "uint8", chunks=(1 << 20,), compression="gzip",
            fillvalue=0,
        )  # fmt: skip
    reseal(newest)


def unlisted_shard_table(newest, outside):
    with open(os.path.join(newest, "shards.json"), "w") as f:
        json.dump({"variables": []}, f)


def symlinked_checkpoint(newest, outside):
    moved = os.path.join(outside, "ckpt-copy")
    shutil.move(newest, moved)
    os.symlink(moved, newest)
    for root, _, names in os.walk(moved):
        for name in names:
            os.utime(os.path.join(root, name), (0, time.time()))


def odd_names(newest, outside):
    chief = os.path.dirname(newest)
    for name in ("ckpt-00000009\n", "ckpt-" + "\u0669" * 8, "ckpt-" + "9" * 250):
        shutil.copytree(newest, os.path.join(chief, name))
    shutil.rmtree(newest)  # So that ckpt-00000002 is the one a resume uses.


def retyped_weights(newest, outside, as_string: bool):
    """Every float32 value of the weights file rewritten as float16 (or as
    the string of its first element), with a valid manifest."""
    path = os.path.join(newest, "model.weights.h5")
    with h5py.File(path, "a") as f:
        names = []
        f.visititems(
            lambda name, item: (
                names.append(name)
                if isinstance(item, h5py.Dataset) and item.dtype == np.float32
                else None
            )
        )
        for name in names:
            value = f[name][()]
            del f[name]
            f[name] = str(value.flat[0]) if as_string else value.astype("float16")
    reseal(newest)


def float16_weights(newest, outside):
    retyped_weights(newest, outside, as_string=False)


def string_weights(newest, outside):
    retyped_weights(newest, outside, as_string=True)


def edit_metadata(newest, change):
    """`change(metadata)`, then a valid manifest."""
    path = os.path.join(newest, "metadata.json")
    with open(path) as f:
        metadata = json.load(f)
    change(metadata)
    with open(path, "w") as f:
        json.dump(metadata, f)
    reseal(newest)


def nested(levels: int):
    tree: dict = {}
    for _ in range(levels):
        tree = {"a": tree}
    return tree


def deep_state(newest, outside):
    edit_metadata(newest, lambda m: m["state"].update(deep=nested(400)))


def far_saved_at(newest, outside):
    edit_metadata(newest, lambda m: m.update(saved_at=1e300))


def replace_array(newest, reference: dict, value: np.ndarray) -> None:
    """Puts `value` where the metadata's array `reference` points."""
    with h5py.File(os.path.join(newest, "arrays.h5"), "a") as f:
        name = reference["__keras_ft_array__"]
        del f[name]
        f[name] = value
    reseal(newest)


def history_a_string(newest, outside):
    edit_metadata(
        newest,
        lambda m: m["state"].update(callbacks={"History:0": {"history": "oops"}}),
    )


def short_python_rng(newest, outside):
    with open(os.path.join(newest, "metadata.json")) as f:
        python = json.load(f)["state"]["rng"]["python"]
    replace_array(newest, python[1], np.arange(10, dtype="uint32"))


CASES = {
    "symlinked manifest": (symlinked_manifest, "symlink"),
    "symlinked weights file": (symlinked_weights, "model.weights.h5"),
    "FIFO manifest": (fifo_manifest, "not a regular file"),
    "FIFO weights file": (fifo_weights, "model.weights.h5"),
    "/dev/zero metadata": (dev_zero_metadata, "metadata.json"),
    "sparse 8 GiB metadata": (sparse_metadata, "metadata.json"),
    "sparse 8 GiB metadata, resealed": (sparse_metadata_resealed, "metadata.json"),
    "deeply nested manifest": (deep_manifest, "not valid JSON"),
    "65 MB manifest": (huge_manifest, "too large"),
    "manifest is a directory": (manifest_is_a_directory, "not a regular file"),
    "HDF5 external link": (external_link_arrays, "arrays.h5"),
    "HDF5 external raw storage": (external_raw_arrays, "arrays.h5"),
    "HDF5 compressed bomb": (compressed_bomb_arrays, "arrays.h5"),
    "unlisted shards.json": (unlisted_shard_table, "does not list"),
    "symlinked checkpoint directory": (symlinked_checkpoint, None),
    "odd checkpoint names": (odd_names, None),
    "weights as strings": (string_weights, "not numbers"),
    "state nested 400 levels deep": (deep_state, "nested more than"),
    "saved_at of 1e300": (far_saved_at, "saved_at"),
    "Python generator state of the wrong size": (short_python_rng, "random"),
    "History.history a string": (history_a_string, "History:0.history"),
}


@ONCE
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_checkpoint_is_skipped_everywhere_and_nothing_outside_is_touched(
    world, case, capsys
):
    backup, newest, outside = world
    alter, reason = CASES[case]
    alter(newest, outside)
    for name in os.listdir(outside):  # What the alteration itself read.
        path = os.path.join(outside, name)
        if os.path.isfile(path):
            os.utime(path, (0, os.stat(path).st_mtime))
    before = outside_state(outside)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10

    # The restore: falls back to ckpt-00000002, naming the problem.
    model = make_model()
    state = keras_ft.WorkerTrainingState(model, backup)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = bounded(state.restore)
    assert point.checkpoint.endswith("ckpt-00000002"), point
    if reason is not None:
        said = " ".join(str(w.message) for w in caught)
        assert "ckpt-00000003" in said and reason in said, said

    # watch() yields the good ones and skips the hostile one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen = bounded(lambda: [c.sequence for c in keras_ft.watch(backup, timeout=0)])
    assert seen == [1, 2]

    # The command line: no traceback, and a resume would use ckpt-00000002.
    said = {}
    for command in ("ls", "verify"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            status = bounded(lambda command=command: cli.main([command, backup]))
        assert status == 0, (command, out.getvalue())
        said[command] = out.getvalue()
    resume_row = [r for r in said["ls"].splitlines() if "a resume uses" in r]
    assert len(resume_row) == 1 and resume_row[0].split()[0] == "2", said["ls"]
    assert "a resume would use" in said["verify"]
    assert said["verify"].rstrip().endswith("ckpt-00000002: good"), said["verify"]
    exported = os.path.join(os.path.dirname(backup), "export.weights.h5")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert bounded(lambda: cli.main(["export", backup, "--out", exported])) == 0
    assert "ckpt-00000002" in out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert bounded(lambda: cli.main(["prune", backup, "--keep", "1"])) == 0
    kept = [
        c.name for c in keras_ft.WorkerTrainingState(make_model(), backup).checkpoints()
    ]
    assert "ckpt-00000002" in kept and "ckpt-00000001" not in kept

    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak
    assert grown < MEMORY_BOUND, f"the peak memory grew by {grown >> 20} MB"
    after = outside_state(outside)
    assert {p: v[:2] for p, v in after.items()} == {
        p: v[:2] for p, v in before.items()
    }, "a file outside the backup changed"
    if atime_tells_reads(outside):
        read = [p for p in after if after[p][2] != before[p][2]]
        assert read == [], f"read outside the backup: {read}"


@ONCE
def test_a_symlinked_chief_directory_is_refused_and_its_target_untouched(world):
    backup, newest, outside = world
    chief = os.path.join(backup, "chief")
    target = os.path.join(outside, "chief")
    shutil.move(chief, target)
    os.symlink(target, chief)
    before = outside_state(outside)
    target_mtime = os.stat(target).st_mtime_ns
    # fit() refuses it before it writes (or creates and deletes) anything there.
    x, y = make_data()
    with pytest.raises(ValueError, match="symlink"):
        make_model().fit(
            x, y, epochs=1, verbose=0, callbacks=[keras_ft.BackupAndRestore(backup)]
        )
    assert os.stat(target).st_mtime_ns == target_mtime, "written into the link"
    state = keras_ft.WorkerTrainingState(make_model(), backup)
    with pytest.raises(ValueError, match="symlink"), state.locked():
        state.restore()
    with pytest.raises(ValueError, match="symlink"):
        list(keras_ft.watch(backup, timeout=0))
    for command in (
        ["ls", backup],
        ["verify", backup],
        ["prune", backup, "--keep", "1"],
    ):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert cli.main(command) == 1, command  # A problem, named.
        assert "symlink" in err.getvalue() and "Traceback" not in err.getvalue()
    assert outside_state(outside) == before
    assert os.stat(target).st_mtime_ns == target_mtime


@ONCE
def test_a_hard_linked_file_is_never_written_through(tmp_path):
    """A `cp -al` snapshot of the backup shares the checkpoints' files: the
    saves that recycle a retired checkpoint's file must leave it alone, and
    never even open it for writing (every open of the process is watched)."""
    x, y = make_data()
    model = make_model(units=20000)  # Files big enough to be recycled.
    backup = str(tmp_path / "backup")
    state = keras_ft.WorkerTrainingState(model, backup, keep=1)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    state.back_up(0)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    first = os.path.join(backup, "chief", "ckpt-00000001", "model.weights.h5")
    os.link(first, snapshot / "model.weights.h5")
    kept = (snapshot / "model.weights.h5").read_bytes()
    linked = os.stat(first)
    real_open, written_through = os.open, []

    def watched_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if flags & (os.O_WRONLY | os.O_RDWR) and os.path.samestat(os.fstat(fd), linked):
            written_through.append(path)
        return fd

    os.open = watched_open
    try:
        for epoch in range(1, 5):
            model.fit(x, y, epochs=1, batch_size=16, verbose=0)
            state.back_up(epoch)
        state.wait()
    finally:
        os.open = real_open
    assert (snapshot / "model.weights.h5").read_bytes() == kept
    assert written_through == []


@ONCE
def test_hostile_objects_in_a_bucket_fall_back_or_are_ignored():
    """memory://: a deeply nested manifest, or an object the manifest does
    not list, makes a checkpoint damaged (fall back); a nested lease is no
    lease."""
    import fsspec

    backup = f"memory://hostile-{os.getpid()}-{time.monotonic_ns()}"
    x, y = make_data()
    model = make_model()
    state = keras_ft.WorkerTrainingState(model, backup, keep=3)
    for epoch in range(3):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        state.back_up(epoch)
    fs = fsspec.filesystem("memory")
    chief = backup.split("://", 1)[1] + "/chief"
    fs.pipe_file(f"{chief}/ckpt-00000003/{MANIFEST_FILE}", b"[" * 200_000)
    fs.pipe_file(f"{chief}/ckpt-00000002/shards.json", b'{"variables": []}')
    fs.pipe_file(f"{chief}/.lease.json", b"[" * 200_000)
    fresh = keras_ft.WorkerTrainingState(make_model(), backup)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fresh.locked():
            point = fresh.restore()
    fresh.unlock()
    said = " ".join(str(w.message) for w in caught)
    assert "ckpt-00000003" in said and "not valid JSON" in said, said
    assert "ckpt-00000002" in said and "does not list" in said, said
    assert point.checkpoint.endswith("ckpt-00000001")


def test_a_forged_build_config_is_refused_before_the_model_is_built(tmp_path):
    """An unbuilt model is built from the backup's build_config: one forged
    to build a 4 GB kernel is refused as damage (the copy of the model that
    measures it allocates nothing), and the restore falls back."""
    x, y = make_data()
    model = make_model(built=False)
    backup = str(tmp_path / "backup")
    state = keras_ft.WorkerTrainingState(model, backup, keep=3)
    for epoch in range(2):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        state.back_up(epoch)
    state.wait()
    newest = os.path.join(backup, "chief", "ckpt-00000002")
    path = os.path.join(newest, "metadata.json")
    with open(path) as f:
        metadata = json.load(f)
    assert metadata["build_config"]["input_shape"][-1] == 4
    metadata["build_config"]["input_shape"][-1] = 1 << 27  # 1 << 27 x 8 floats.
    with open(path, "w") as f:
        json.dump(metadata, f)
    reseal(newest)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10

    fresh = make_model(built=False)
    state = keras_ft.WorkerTrainingState(fresh, backup)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = bounded(state.restore)
    said = " ".join(str(w.message) for w in caught)
    assert point.checkpoint.endswith("ckpt-00000001"), said
    assert "ckpt-00000002" in said and "build_config" in said, said
    assert [tuple(w.shape) for w in fresh.weights][0] == (4, 8)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak
    assert grown < MEMORY_BOUND, f"the peak memory grew by {grown >> 20} MB"
    fresh.fit(x, y, epochs=1, batch_size=16, verbose=0)  # Trains on.


@ONCE
def test_weights_of_another_dtype_are_refused_by_the_restore_not_cast(world):
    """float16 values where the model saves float32, with a valid manifest:
    only a restore knows the model's dtypes, and it falls back rather than
    casting them."""
    backup, newest, outside = world
    float16_weights(newest, outside)
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = keras_ft.WorkerTrainingState(model, backup).restore()
    said = " ".join(str(w.message) for w in caught)
    assert point.checkpoint.endswith("ckpt-00000002"), said
    assert "ckpt-00000003" in said and "float16" in said and "cast" in said, said
    # What watch() yields is loaded with load_checkpoint(): refused, clearly.
    with pytest.raises(keras_ft.CorruptCheckpointError, match="float16"):
        keras_ft.load_checkpoint(newest, make_model())
    before = [keras.ops.convert_to_numpy(v) for v in model.weights]
    keras_ft.load_checkpoint(os.path.join(backup, "chief", "ckpt-00000002"), model)
    for a, b in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(b))


@ONCE
def test_a_checkpoint_swapped_for_a_link_after_it_was_listed_is_not_read(world):
    """The race a check-then-open loses: `ckpt-00000003` is replaced by a
    link to an outside copy of itself (same bytes, so every checksum
    matches) after `watch()` listed it and before it is loaded. Every file
    is checked on its open descriptor: nothing outside is read."""
    backup, newest, outside = world
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        listed = list(keras_ft.watch(backup, timeout=0))
    assert [c.sequence for c in listed] == [1, 2, 3]
    copy = os.path.join(outside, "ckpt-00000003")
    shutil.copytree(newest, copy)
    for root, _, names in os.walk(copy):
        for name in names:
            os.utime(os.path.join(root, name), (0, time.time()))
    shutil.rmtree(newest)
    os.symlink(copy, newest)
    before = outside_state(outside)

    model = make_model()
    with pytest.raises(keras_ft.CheckpointError, match="ckpt-00000003"):
        keras_ft.load_checkpoint(listed[-1], model)
    for name in ("metadata.json", "model.weights.h5"):  # The check itself.
        with pytest.raises(ValueError, match="symlink"):
            file_io.open_regular(os.path.join(newest, name), depth=3)
    os.close(file_io.open_regular(os.path.join(newest, "metadata.json")))  # Depth 1.
    # The restore lists again, and falls back.
    state = keras_ft.WorkerTrainingState(make_model(), backup)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert state.restore().checkpoint.endswith("ckpt-00000002")
    after = outside_state(outside)
    assert {p: v[:2] for p, v in after.items()} == {p: v[:2] for p, v in before.items()}
    if atime_tells_reads(outside):
        read = [p for p in after if after[p][2] != before[p][2]]
        assert read == [], f"read outside the backup: {read}"


@ONCE
def test_a_planted_spare_link_is_never_written_through(tmp_path):
    """A `.spare-*` link to an outside directory holding a file of the
    weights file's name: the next saves neither move nor overwrite it."""
    x, y = make_data()
    model = make_model(units=20000)  # Files big enough to be recycled.
    backup = str(tmp_path / "backup")
    state = keras_ft.WorkerTrainingState(model, backup, keep=1)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    state.back_up(0)
    state.wait()
    chief = os.path.join(backup, "chief")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "model.weights.h5"
    victim.write_bytes(SECRET * 4096)
    os.symlink(outside, os.path.join(chief, ".spare-000000000000"))
    for epoch in range(1, 4):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        state.back_up(epoch)
    state.wait()
    assert victim.read_bytes() == SECRET * 4096
    assert sorted(os.listdir(outside)) == ["model.weights.h5"]
    assert keras_ft.WorkerTrainingState(make_model(units=20000), backup).restore()


@ONCE
def test_a_staging_directory_swapped_for_a_link_is_written_as_opened(tmp_path):
    """The files of a save go into the staging directory as it was opened:
    if its name is swapped for a link meanwhile, nothing lands outside."""
    from keras_ft.checkpoint.local import LocalStorage

    storage = LocalStorage(str(tmp_path / "chief"))
    staging = storage.stage(None)
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = str(tmp_path / "moved")
    os.rename(staging.path, moved)
    os.symlink(outside, staging.path)
    staging.write_file("a.bin", [b"x" * 100])
    with open(os.path.join(staging, "b.bin"), "wb") as f:  # By path, as h5py does.
        f.write(b"y")
    assert os.listdir(outside) == []
    assert sorted(os.listdir(moved)) == ["a.bin", "b.bin"]


@ONCE
def test_links_named_like_leftovers_are_listed_as_foreign_and_never_followed(world):
    """`.spare-*`, `.trash-*`, `.staging-*` and `.parts-*` links to a
    directory outside: `ls`, `verify`, `prune` and a training's start and
    saves name them, never list, read or write what they point to, and
    remove only the links."""
    backup, newest, outside = world
    target = os.path.join(outside, "elsewhere")
    os.mkdir(target)
    with open(os.path.join(target, "model.weights.h5"), "wb") as f:
        f.write(SECRET * 1024)
    chief = os.path.dirname(newest)
    links = [".spare-000000000000", ".trash-0", ".staging-1-2", ".parts-3"]
    for name in links:
        os.symlink(target, os.path.join(chief, name))
    os.utime(target, (0, time.time()))
    for name in os.listdir(target):
        os.utime(os.path.join(target, name), (0, time.time()))
    before = outside_state(outside)  # Lists `target`: its access time is reset.
    os.utime(target, ns=(0, os.stat(target).st_mtime_ns))

    said = {}
    for command in ("ls", "verify"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main([command, backup]) == 0, out.getvalue()
        said[command] = out.getvalue()
    for name in links:
        for command in ("ls", "verify"):
            rows = [r for r in said[command].splitlines() if name in r]
            assert len(rows) == 1 and "foreign entry" in rows[0], said[command]
            assert "partial leftover" not in rows[0], said[command]
    assert "5.0 MB" not in said["ls"] and "elsewhere" not in said["ls"], said["ls"]
    if atime_tells_reads(outside):
        assert os.stat(target).st_atime_ns == 0, "the linked directory was listed"

    # A training's start removes the links (only), and its saves go on.
    x, y = make_data()
    model = make_model()
    state = keras_ft.WorkerTrainingState(model, backup, keep=3)
    with state.locked():
        state.restore()
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        state.back_up(3)
        state.wait()
    assert not any(os.path.lexists(os.path.join(chief, n)) for n in links)
    for name in links:  # And `prune`, planted again.
        os.symlink(target, os.path.join(chief, name))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["prune", backup, "--keep", "1"]) == 0
    assert not any(os.path.lexists(os.path.join(chief, n)) for n in links)

    after = outside_state(outside)
    assert {p: v[:2] for p, v in after.items()} == {
        p: v[:2] for p, v in before.items()
    }, "a file outside the backup changed"
    assert sorted(os.listdir(target)) == ["model.weights.h5"]
    if atime_tells_reads(outside):
        read = [p for p in after if after[p][2] != before[p][2]]
        assert read == [], f"read outside the backup: {read}"


# Malformed state that a fit() meets only when it resumes: the restore falls
# back, nothing of the damaged checkpoint is set, and training goes on.


class AtTrainBegin(keras.callbacks.Callback):
    """Keeps the model's variables as the restore left them."""

    def on_train_begin(self, logs=None):
        self.variables = [
            keras.ops.convert_to_numpy(v)
            for v in self.model.weights + self.model.optimizer.variables
        ]


def fit_with(backup: str, epochs: int, *more):
    x, y = make_data()
    model = make_model()
    callbacks = [
        keras_ft.BackupAndRestore(backup, keep=3, delete_checkpoint=False),
        keras.callbacks.EarlyStopping(
            monitor="loss", patience=100, restore_best_weights=True
        ),
        *more,
    ]
    model.fit(x, y, epochs=epochs, batch_size=16, verbose=0, callbacks=callbacks)
    return model


@pytest.fixture(scope="module")
def pristine_fit(tmp_path_factory):
    """A backup of three epochs of fit(), with EarlyStopping's and History's
    state in it."""
    backup = str(tmp_path_factory.mktemp("pristine_fit") / "backup")
    fit_with(backup, 3)
    return backup


def in_state(*path):
    def change(metadata, value):
        node = metadata["state"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def callback_value(path, value):
    return lambda newest: edit_metadata(newest, lambda m: in_state(*path)(m, value))


def torch_state_of_the_wrong_size(newest):
    with open(os.path.join(newest, "metadata.json")) as f:
        rng_state = json.load(f)["state"]["rng"]
    if "torch" not in rng_state:
        pytest.skip("no PyTorch generator state on this backend")
    replace_array(newest, rng_state["torch"], np.zeros(100, "uint8"))


def best_weights_of_other_shapes(newest):
    edit_metadata(
        newest,
        lambda m: in_state("callbacks", "EarlyStopping:0", "best_weights")(
            m, [1.0, 2.0]
        ),
    )


FIT_CASES = {
    "History.history a string": (
        callback_value(("callbacks", "History:0", "history"), "oops"),
        "History:0.history",
    ),
    "EarlyStopping.wait negative": (
        callback_value(("callbacks", "EarlyStopping:0", "wait"), -3),
        "EarlyStopping:0.wait",
    ),
    "EarlyStopping.best_weights not weights": (
        best_weights_of_other_shapes,
        "EarlyStopping:0.best_weights",
    ),
    "logs a list": (callback_value(("logs",), [1, 2]), "logs"),
    "epoch-begin NumPy generator position past its keys": (
        callback_value(("epoch_begin_rng", "numpy", "pos"), 10**6),
        "random",
    ),
    "a stream's PyTorch generator state not bytes": (
        callback_value(("input",), {"stream": 1, "stream_rng": {"torch": "x"}}),
        "PyTorch",
    ),
    "PyTorch generator state of the wrong size": (
        torch_state_of_the_wrong_size,
        "PyTorch",
    ),
    "state nested 400 levels deep": (
        lambda newest: deep_state(newest, None),
        "nested more than",
    ),
    "saved_at of 1e300": (lambda newest: far_saved_at(newest, None), "saved_at"),
}


@pytest.mark.parametrize("case", list(FIT_CASES))
def test_malformed_state_makes_fit_fall_back_with_nothing_of_it_set(
    pristine_fit, tmp_path, case
):
    backup = str(tmp_path / "backup")
    shutil.copytree(pristine_fit, backup)
    before, newest = keras_ft.WorkerTrainingState(make_model(), backup).checkpoints()[
        -2:
    ]
    alter, reason = FIT_CASES[case]
    alter(newest.path)
    expected = make_model()
    keras_ft.load_checkpoint(before.path, expected)
    restored = AtTrainBegin()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fit_with(backup, 5, restored)
    said = " ".join(str(w.message) for w in caught)
    assert newest.name in said and reason in said, said
    # The checkpoint before, whole: nothing of the damaged one was set.
    wanted = expected.weights + expected.optimizer.variables
    for value, variable in zip(restored.variables, wanted, strict=True):
        np.testing.assert_array_equal(value, keras.ops.convert_to_numpy(variable))
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 5 * 4
