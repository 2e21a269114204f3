"""Backups in object storage: a real S3-protocol server (moto) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import fsspec
import keras
import numpy as np
import pytest
from conftest import (
    BUCKET,
    STEPS_PER_EPOCH,
    iterations,
    make_model,
    run_once_on,
    start_moto,
    subprocess_env,
    weights_of,
)

import keras_ft
from keras_ft.checkpoint import remote, scratch, transfers

ONCE = run_once_on("jax", "subprocesses against the server")


def s3() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3", skip_instance_cache=True)


def url(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{os.getpid()}-{time.monotonic_ns()}"


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_interrupted_and_resumed_from_object_storage(s3_server, data, where, capsys):
    x, y = data
    backup = url("resume") if where == "s3" else f"memory://resume-{time.time_ns()}"
    keras.utils.set_random_seed(1)
    reference = make_model()
    reference.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0)

    keras.utils.set_random_seed(1)
    with pytest.raises(RuntimeError, match="interrupted"):
        make_model().fit(
            x, y, epochs=3, batch_size=16, shuffle=False, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup, save_freq=3), Interrupt()],
        )  # fmt: skip
    keras_ft.wait_for_backups()
    fs, root = fsspec.core.url_to_fs(backup)
    fs.invalidate_cache()
    names = sorted(p[len(root) :] for p in fs.find(root))
    # The same layout as on disk.
    assert "/chief/ckpt-00000002/manifest.json" in names
    assert {n.rsplit("/", 1)[1] for n in names if "ckpt-00000002" in n} == {
        "manifest.json", "metadata.json", "model.weights.h5", "arrays.h5",
    }  # fmt: skip

    keras.utils.set_random_seed(2)  # The backup's random state wins.
    resumed = make_model()
    resumed.fit(
        x, y, epochs=3, batch_size=16, shuffle=False, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup, save_freq=3)],
    )  # fmt: skip
    out = capsys.readouterr().out
    assert f"restored {backup}/chief/ckpt-00000002" in out
    assert iterations(resumed) == 3 * STEPS_PER_EPOCH
    for mine, theirs in zip(weights_of(resumed), weights_of(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    fs.invalidate_cache()
    assert not [p for p in fs.find(root) if "/ckpt-" in p]  # Finished: deleted.


@ONCE
def test_a_damaged_object_falls_back_to_the_previous_checkpoint(s3_server, data):
    x, y = data
    backup = url("damaged")
    make_model().fit(
        x, y, epochs=2, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup, delete_checkpoint=False)],
    )  # fmt: skip
    fs = s3()
    key = f"{backup[5:]}/chief/ckpt-00000002/model.weights.h5"
    damaged = bytearray(fs.cat_file(key))
    damaged[len(damaged) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(damaged))
    resumed = make_model()
    with pytest.warns(UserWarning, match="ckpt-00000002.*checksum.*Falling back"):
        resumed.fit(
            x, y, epochs=3, batch_size=16, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup)],
        )  # fmt: skip
    assert iterations(resumed) == 3 * STEPS_PER_EPOCH
    assert [c.sequence for c in keras_ft.watch(backup, timeout=0)] == []


@ONCE
@pytest.mark.parametrize("damage", [None, "flipped", "longer", "shorter", "missing"])
def test_a_restore_checksums_the_download_as_its_ranges_arrive(
    s3_server, data, monkeypatch, tmp_path, damage
):
    # Ranges of 1 KiB: the weights file arrives in dozens of ranges fetched
    # concurrently and out of order; its checksum and the loader follow.
    # Downloads go to a temporary directory of this test's own: another
    # suite running beside this one downloads too.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(transfers, "STREAM_MIN", 4096)
    monkeypatch.setattr(transfers, "STREAM_RANGE", 1024)
    monkeypatch.setattr(transfers, "STREAM_RANGE_MAX", 1024)
    x, y = data
    backup = url("ranges")
    model = make_model(units=256)
    model.fit(
        x, y, epochs=2, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup, delete_checkpoint=False)],
    )  # fmt: skip
    fs = s3()
    key = f"{backup[5:]}/chief/ckpt-00000002/model.weights.h5"
    weights = fs.cat_file(key)
    assert len(weights) > 20 * 1024
    if damage == "flipped":
        changed = bytearray(weights)
        changed[len(changed) // 2] ^= 0xFF
        fs.pipe_file(key, bytes(changed))
    elif damage == "longer":
        fs.pipe_file(key, weights + b"\0")
    elif damage == "shorter":
        fs.pipe_file(key, weights[:-1024])
    elif damage == "missing":
        fs.rm_file(key)
    downloads_before = set(os.listdir(tempfile.gettempdir()))
    restored = make_model(units=256)
    state = keras_ft.WorkerTrainingState(restored, backup)
    if damage is None:
        assert state.restore().epoch == 2
        for mine, saved in zip(weights_of(restored), weights_of(model), strict=True):
            np.testing.assert_array_equal(mine, saved)
    else:
        with pytest.warns(UserWarning, match="ckpt-00000002.*Falling back"):
            assert state.restore().epoch == 1
    state.close()
    # Nothing of the download is left behind.
    left = set(os.listdir(tempfile.gettempdir())) - downloads_before
    assert not [n for n in left if n.startswith("keras-ft-download-")]


_WRITER = textwrap.dedent(
    """
    import sys, time
    import keras, numpy as np
    import keras_ft

    class Committed(keras_ft.CheckpointListener):
        def after_commit(self, path, epoch, step):
            print("COMMIT", path, step, flush=True)

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(float(sys.argv[2]))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024),
                              keras.layers.Dense(1)])  # ~0.3 M parameters.
    model.compile("adam", "mse")
    model.fit(x, y, epochs=int(sys.argv[3]), batch_size=16, verbose=0,
              shuffle=False, callbacks=[
        keras_ft.BackupAndRestore(sys.argv[1], save_freq=1, listeners=[Committed()]),
        Slow()])
    print("STEPS", int(model.optimizer.iterations), flush=True)
    """
)


def start_writer(
    tmp_path, backup, pause, epochs, tmpdir=None, endpoint=None
) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = subprocess_env()
    env.update({k: os.environ[k] for k in os.environ if k.startswith("AWS_")})
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)  # Another machine: nothing local carried over.
    if endpoint is not None:
        env["AWS_ENDPOINT_URL"] = endpoint
    return subprocess.Popen(
        [sys.executable, str(script), backup, str(pause), str(epochs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def listing(backup: str) -> dict[str, set[str]]:
    fs = s3()
    found: dict[str, set[str]] = {}
    for path in fs.find(f"{backup[5:]}/chief"):
        parts = path.rsplit("/", 2)
        if parts[-2].startswith("ckpt-"):
            found.setdefault(parts[-2], set()).add(parts[-1])
    return found


class SlowRelay:
    """A TCP relay on loopback in front of the S3 server. Once `slow` is set,
    what clients send goes on in pieces of `piece` bytes, `pause` seconds
    apart: an upload of a checkpoint lasts seconds, long enough for a kill to
    land inside it however loaded the machine is."""

    def __init__(self, port: int, pause: float = 0.25, piece: int = 64 * 1024):
        self.target, self.pause, self.piece = port, pause, piece
        self.slow = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # Closed.
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            for source, sink, slowed in (
                (client, server, True),
                (server, client, False),
            ):
                threading.Thread(
                    target=self._pass, args=(source, sink, slowed), daemon=True
                ).start()

    def _pass(self, source: socket.socket, sink: socket.socket, slowed: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(self.piece):
                if slowed and self.slow.is_set():
                    time.sleep(self.pause)
                sink.sendall(data)
        for end in (source, sink):  # One side gone: the connection is over.
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@ONCE
def test_sigkill_during_an_upload_resumes_from_the_previous_commit(s3_server, tmp_path):
    """Killed while a checkpoint's files are uploaded (no manifest yet): a new
    machine resumes from the newest committed one, and the partial goes."""

    def uploading(found: dict[str, set[str]]) -> list[str]:
        # Files without a manifest, newer than every committed checkpoint: an
        # older one without its manifest is being deleted (manifest first),
        # which a kill does not leave behind when it was one bulk request.
        committed = [n for n, files in found.items() if "manifest.json" in files]
        newest = max(committed, default="")
        return [
            n for n, files in found.items() if "manifest.json" not in files
            and n > newest
        ]  # fmt: skip

    host = tmp_path / "host"  # The killed writer's local disk.
    host.mkdir()
    # The writer reaches the bucket through a relay that, after its third
    # commit, slows what it sends: the next checkpoint's small files arrive,
    # its weights take seconds, and the kill lands in between.
    relay = SlowRelay(int(s3_server["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    backup = url("kill")
    writer = start_writer(
        tmp_path, backup, 0.0, 50, tmpdir=host, endpoint=relay.endpoint
    )
    try:
        commits = 0
        for line in writer.stdout:
            commits += line.startswith("COMMIT")
            if commits == 3:
                break
        relay.slow.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not uploading(listing(backup)):
            time.sleep(0.05)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
        relay.close()
    found = listing(backup)
    partial = uploading(found)
    assert partial, "the kill did not land during an upload"
    committed = max(n for n, files in found.items() if "manifest.json" in files)
    expected_step = json.loads(
        s3().cat_file(f"{backup[5:]}/chief/{committed}/metadata.json")
    )["step"]

    new_machine = tmp_path / "elsewhere"
    new_machine.mkdir()
    resumed = start_writer(tmp_path, backup, 0.0, 1, tmpdir=new_machine)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"restored {backup}/chief/{committed} " in out
    assert f"optimizer step {expected_step}." in out
    assert not [n for n in partial if n in listing(backup)]  # Removed.
    # The killed writer's staged upload is still on its disk, until the
    # next keras-ft process there reaps what dead processes left.
    staged = sorted(str(p) for p in host.glob("keras-ft-upload-*") if p.is_dir())
    assert staged
    assert sorted(scratch.reap(str(host))) == staged
    assert not list(host.iterdir())


@ONCE
def test_two_writers_on_one_prefix(s3_server, tmp_path, data):
    backup = url("two")
    first = start_writer(tmp_path, backup, 0.2, 100)
    for line in first.stdout:
        if line.startswith("COMMIT"):
            break
    x, y = data
    try:
        with pytest.raises(keras_ft.DirectoryInUseError, match=f"pid {first.pid}"):
            make_model().fit(
                x, y, epochs=1, batch_size=16, verbose=0,
                callbacks=[keras_ft.BackupAndRestore(backup)],
            )  # fmt: skip
        assert first.poll() is None  # The first one trains on, untouched.
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # Its holder is gone (same host, no such process): the lease is taken over.
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024),
                              keras.layers.Dense(1)])  # fmt: skip
    model.compile("adam", "mse")
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(256, 64)).astype("float32")
    model.fit(xs, xs.sum(axis=1, keepdims=True), epochs=1, batch_size=16, verbose=0,
              callbacks=[keras_ft.BackupAndRestore(backup)])  # fmt: skip


def test_one_url_on_two_servers_is_two_backups(monkeypatch, tmp_path):
    """Local names made for a bucket backup (a worker's scratch directory and
    its lock, the local tier, the lease held in this process) tell servers
    apart, so that two jobs on one host writing the same bucket path on two
    servers never share them; credentials do not, and with no endpoint
    given they are as before (a tier made before is still found)."""
    import hashlib

    from keras_ft.distribute.cluster import TaskSpec
    from keras_ft.saves.tiers import local_tier_dir

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    backup, task = "s3://bucket/run", TaskSpec()

    def names(**options):
        storage = remote.ObjectStorage(backup, options or None)
        lease = remote.RemoteLease(storage)
        tier = local_tier_dir(str(tmp_path), storage, task)
        return storage.housekeeping.scratch_dir("workertemp_1"), tier, lease._ident

    default = names()
    digest = hashlib.sha1(backup.encode()).hexdigest()[:12]
    assert os.path.basename(default[0]) == f"keras-ft-{digest}-workertemp_1"
    assert os.path.basename(default[1]) == f"tier-{digest}"
    one = names(client_kwargs={"endpoint_url": "http://127.0.0.1:9001"})
    other = names(client_kwargs={"endpoint_url": "http://127.0.0.1:9002"})
    assert len({*default, *one, *other}) == 9, (default, one, other)
    assert (
        names(
            key="a", secret="b", client_kwargs={"endpoint_url": "http://127.0.0.1:9001"}
        )
        == one
    )
    # An object's text may differ from process to process: not a name.
    assert names(config_kwargs={"endpoint_resolver": object()}) == default
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    from_env = names()
    assert from_env != default and from_env != one
    # The client's own order: the S3-specific variable wins.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9002")
    assert names() != from_env


def test_a_missing_filesystem_package_names_the_extra(tmp_path):
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"keras-ft\[gcs\]"):
            keras_ft.BackupAndRestore("gs://some-bucket/run")
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ValueError, match="storage_options"):
        keras_ft.BackupAndRestore("memory://x", storage_options="key=1")


@ONCE
def test_the_command_line_reads_and_prunes_a_bucket(s3_server, data):
    x, y = data
    backup = url("cli")
    trained = make_model()
    trained.fit(
        x, y, epochs=3, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup, keep=3, delete_checkpoint=False)],
    )  # fmt: skip
    keras_ft.wait_for_backups()
    # What a writer killed mid-upload leaves: files, no manifest.
    s3().pipe_file(f"{backup[5:]}/chief/ckpt-00000004/model.weights.h5", b"partial")
    seen = [c.sequence for c in keras_ft.watch(backup, timeout=0)]
    assert seen == [1, 2, 3]
    evaluator = make_model()
    loaded = keras_ft.load_checkpoint(backup, evaluator)
    assert loaded.path == f"{backup}/chief/ckpt-00000003" and loaded.step == 12
    for mine, theirs in zip(weights_of(evaluator), weights_of(trained), strict=True):
        np.testing.assert_array_equal(mine, theirs)

    env = subprocess_env()
    env.update(s3_server)
    command = [os.path.join(os.path.dirname(sys.executable), "keras-ft")]

    def run(*args):
        return subprocess.run([*command, *args], capture_output=True, text=True,
                              env=env, timeout=300)  # fmt: skip

    listed = run("ls", backup)
    assert listed.returncode == 0, listed.stderr
    assert "a resume uses this one" in listed.stdout.splitlines()[4]
    assert "partial leftover (ckpt-00000004)" in listed.stdout
    verified = run("verify", backup)
    assert verified.returncode == 0 and "ckpt-00000003: good" in verified.stdout
    pruned = run("prune", backup, "--keep", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(listing(backup)) == ["ckpt-00000003"]


class Terminal(io.StringIO):
    """Output that says it is a terminal, as a user's is."""

    def isatty(self):
        return True


def test_long_transfers_draw_their_progress_on_a_terminal(s3_server):
    from keras_ft.checkpoint.remote import ObjectStorage
    from keras_ft.checkpoint.store import CheckpointStore

    where = url("progress") + "/chief"
    terminal = Terminal()
    # Shown from the start (a real one waits 2 s): the server is fast.
    storage = ObjectStorage(where, progress=terminal, progress_after=0.0)
    store = CheckpointStore(where, storage=storage)
    big = os.urandom(3 << 20)

    def write(staging):
        staging.write_file("big.bin", [big])
        staging.write_file("small.bin", [b"x" * 100])

    committed = store.save(write, {"step": 1})
    assert store.verify(committed)["step"] == 1
    drawn = terminal.getvalue()
    # One line per checkpoint, redrawn in place, ending whole (3 MB and 100
    # bytes) with a new line.
    (line,) = [ln for ln in drawn.split("\n") if "uploading ckpt-00000001" in ln]
    assert line.startswith("\r")
    last = line.split("\r")[-1].rstrip()
    assert "[" + "=" * 30 + "]" in last and last.split("] ")[1].startswith("3 MB/3 MB")
    # Downloads too, and none of it where the output is not a terminal.
    terminal.truncate(0)
    terminal.seek(0)
    local = storage.reader.local_copy(
        committed, {"big.bin": len(big), "small.bin": 100}
    )
    storage.reader.release(local)
    (line,) = [ln for ln in terminal.getvalue().split("\n") if ln]
    assert "downloading ckpt-00000001" in line and "3 MB/3 MB" in line
    log = io.StringIO()
    quiet = ObjectStorage(where, progress=log, progress_after=0.0)
    store = CheckpointStore(where, storage=quiet)
    store.save(write, {"step": 2})
    assert log.getvalue() == ""


def run_cluster_on_bucket(s3_server, backup, *args, backend="jax"):
    """`examples/local_cluster.py`: two workers (JAX's, unless `backend`
    says) backing up to `backup`; worker 1 gets the fault; the run's
    `RESULT` numbers."""
    import json as json_module

    harness = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "examples", "local_cluster.py",
    )  # fmt: skip
    env = subprocess_env()
    env.update(s3_server)
    result = subprocess.run(
        [sys.executable, harness, "--backend", backend, "--workers", "2",
         "--epochs", "3", "--seconds-per-batch", "0.1", "--backup-dir", backup,
         "--json", "--quiet", "--kill-worker", "1", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    return json_module.loads(line[len("RESULT ") :])


@ONCE
def test_a_cluster_backs_up_to_a_bucket_and_resumes_from_it(s3_server, tmp_path):
    """Two JAX processes: the chief commits to the bucket, the other worker's
    throwaway saves stay local; one is killed, both resume from the bucket."""
    import glob

    backup = url("cluster")
    run = run_cluster_on_bucket(
        s3_server, backup, "--save-freq", "3", "--kill-window", "0.6", "--seed", "1"
    )
    committed = run["committed_step"]
    assert committed and run["exit_codes"] == [0, 0], run
    assert run["resumed_steps"] == [committed, committed]
    assert run["final_steps"] == [3 * 8, 3 * 8]
    assert run["weights"][0] == run["weights"][1]
    # Only the chief's commits are in the bucket; no worker directory.
    assert run["backup_dir_entries"] == ["chief"]
    assert run["chief_entries"] and all(
        name.startswith(("ckpt-", "goodput_")) for name in run["chief_entries"]
    ), run["chief_entries"]
    # The other worker's saves went to a local directory, removed each time.
    # (Named as the workers named it: this process has the same endpoint.)
    scratch_dirs = remote.ObjectStorage(backup).housekeeping.scratch_dir("*")
    assert os.path.basename(scratch_dirs).startswith("keras-ft-")
    assert not glob.glob(scratch_dirs + "*")


@ONCE
@pytest.mark.parametrize("on_save_error", ["raise", "warn"])
def test_a_failing_upload_is_retried_then_reported_like_a_disk_error(
    s3_server, data, on_save_error, monkeypatch
):
    """The server goes away mid-training: each upload is retried with backoff,
    then fails as a disk would (`on_save_error`); nothing is half-committed."""
    import fsspec
    import s3fs

    from keras_ft.checkpoint import transfers

    # The same attempts, a shorter wait between them: every transfer of the
    # epochs after the server went fails, each after its 4 attempts. (s3fs
    # retries each request 5 times itself, 1.9 s of waits: once here.)
    monkeypatch.setattr(transfers, "_BACKOFF_SECONDS", 0.02)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    x, y = data
    server, port = start_moto()
    # The client's own retries are the user's to configure; keep them short.
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 1},
    }
    fsspec.filesystem("s3", **options).mkdir("flaky")

    class ServerGoes(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                keras_ft.wait_for_backups()  # Epoch 1 is committed.
                server.kill()
                server.wait()

    callback = keras_ft.BackupAndRestore(
        "s3://flaky/run", storage_options=options, on_save_error=on_save_error,
        async_save=False,
    )  # fmt: skip
    fit = lambda: make_model().fit(  # noqa: E731
        x, y, epochs=3, batch_size=16, verbose=0, callbacks=[ServerGoes(), callback]
    )
    try:
        if on_save_error == "raise":
            with pytest.raises(keras_ft.CheckpointWriteError, match="attempts"):
                fit()
        else:
            with pytest.warns(UserWarning, match="failed after 4 attempts"):
                history = fit()
            assert history.epoch == [0, 1, 2]  # Training went on.
    finally:
        server.kill()


@ONCE
def test_a_notice_is_created_once_on_the_s3_server(s3_server):
    """The server honours S3's conditional create (If-None-Match), which
    fsspec's `mode="create"` sends: the second writer is refused."""
    from keras_ft.checkpoint.store import CheckpointStore

    store = CheckpointStore(url("notice") + "/chief")
    assert store.create_notice("preempted.json", b'{"first": 1}')
    assert not store.create_notice("preempted.json", b'{"second": 2}')
    assert store.read_notice("preempted.json") == b'{"first": 1}'
    store.remove_notice("preempted.json")
    assert store.read_notice("preempted.json") is None


@ONCE
def test_sigterm_in_a_cluster_backed_up_to_a_bucket(s3_server):
    """The preemption notice goes through the bucket: a SIGTERM to one of two
    JAX workers backs up one step on both, and both exit with 143."""
    run = run_cluster_on_bucket(
        s3_server, url("preempted"), "--save-freq", "5", "--kill-window", "0.3",
        "--signal", "TERM", "--seed", "3",
    )  # fmt: skip
    assert run["exit_codes_after_kill"] == {"0": 143, "1": 143}, run
    committed = run["committed_step"]
    assert committed > run["killed_after_step"]  # The signal's own backup.
    assert run["exit_codes"] == [0, 0], run["stderr_of_failed"]
    assert run["resumed_steps"] == [committed, committed]
    assert run["final_steps"] == [3 * 8, 3 * 8]
    assert run["weights"][0] == run["weights"][1]


@ONCE
def test_a_second_trainer_never_breaks_the_first_on_a_bucket(s3_server):
    """Trainer A saves every batch to the bucket; trainer B starts on the same
    prefix again and again while A uploads: B is refused by the lease before
    it touches anything, and A finishes with every save committed."""
    backup = url("second")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
    env = subprocess_env()
    env.update(s3_server)
    trainer = subprocess.Popen(
        [sys.executable, script, backup, "--epochs", "6", "--save-freq", "1",
         "--units", "20000", "--keep-backup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    for line in trainer.stdout:
        if '"first_batch_end"' in line:
            break
    refused = 0
    try:
        while refused < 3 and trainer.poll() is None:
            second = keras_ft.WorkerTrainingState(make_model(), backup)
            second.check_writable()
            with pytest.raises(
                keras_ft.DirectoryInUseError, match=f"pid {trainer.pid}"
            ):
                second.lock()
            refused += 1
        out, err = trainer.communicate(timeout=240)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err
    assert refused == 3
    assert '"kind": "done", "step": 24' in out
    state = keras_ft.WorkerTrainingState(make_model(units=20000), backup)
    assert state.restore().step == 24
    state.delete_backup()


def test_a_lapsed_lease_taken_over_is_never_written_over(monkeypatch):
    """The first writer's bucket comes back after a second writer took the
    lapsed lease: the first never writes over it, and each of its saves is
    refused as a write error (so `on_save_error="warn"` keeps training)."""
    from keras_ft.checkpoint import remote
    from keras_ft.checkpoint.store import open_store
    from keras_ft.errors import LeaseLapsedError

    monkeypatch.setenv(remote.LEASE_SECONDS_ENV, "1")
    backup = f"memory://taken-{os.getpid()}-{time.monotonic_ns()}/chief"
    first = remote.RemoteLease(open_store(backup).storage)
    second = remote.RemoteLease(open_store(backup).storage)
    first.acquire()
    try:

        def unreachable(*args, **kwargs):
            raise ConnectionError("bucket out of reach")

        monkeypatch.setattr(first, "_write", unreachable)
        time.sleep(1.6)
        second.acquire()  # The first's heartbeat is older than a lease.
        monkeypatch.undo()  # The bucket is back for the first writer.
        time.sleep(1.2)  # Three beats of the first.
        with pytest.raises(LeaseLapsedError, match="taken over") as info:
            first.check()
        assert isinstance(info.value, keras_ft.CheckpointWriteError)
        assert isinstance(info.value, keras_ft.DirectoryInUseError)
        assert first._read()["token"] == second._token
        second.check()
    finally:
        first.release()
        second.release()
    assert first._read() is None


def test_a_later_fit_in_this_process_ends_the_earlier_leases_heartbeat(monkeypatch):
    """A fit() that raised keeps its lease; a later one in the same process
    (a notebook's next cell) takes it over and stops the earlier heartbeat,
    so that once the later one releases it, nothing writes the lease again
    (the earlier beats would keep the prefix in use for as long as the
    kernel lives)."""
    from keras_ft.checkpoint import remote
    from keras_ft.checkpoint.store import open_store

    monkeypatch.setenv(remote.LEASE_SECONDS_ENV, "1.5")  # A beat each 0.5 s.
    backup = f"memory://again-{os.getpid()}-{time.monotonic_ns()}/chief"
    first = remote.RemoteLease(open_store(backup).storage)
    second = remote.RemoteLease(open_store(backup).storage)
    first.acquire()  # Its fit() raises: never released.
    beating = first._beating
    time.sleep(0.7)
    second.acquire()
    assert not beating.is_alive()
    with pytest.raises(keras_ft.DirectoryInUseError, match="taken over"):
        first.check()  # Were its fit() still going, it would not commit.
    second.release()
    time.sleep(1.7)  # Three beats of the first, had it gone on.
    assert second._read() is None
    first.release()  # Not its lease any more: nothing to remove, no error.


def test_a_lease_that_cannot_be_renewed_stops_the_next_commit(data, monkeypatch):
    """The bucket goes out of reach for the heartbeat: once a takeover could
    have happened, the writer's next save is refused before its commit, and
    the checkpoints committed before are intact."""
    from keras_ft.checkpoint import remote

    monkeypatch.setenv(remote.LEASE_SECONDS_ENV, "1.5")
    backup = f"memory://lapsed-{os.getpid()}-{time.monotonic_ns()}"
    state = keras_ft.WorkerTrainingState(make_model(), backup)
    x, y = data
    state.model.fit(x, y, epochs=1, verbose=0)
    state.lock()
    try:
        time.sleep(2.5)  # Renewed by its heartbeat: in force.
        state.back_up(0)

        def unreachable(*args, **kwargs):
            raise ConnectionError("bucket out of reach")

        # The lease's writes; uploads use put_file and still work.
        monkeypatch.setattr(state.store.storage.fs, "pipe_file", unreachable)
        time.sleep(2.5)
        with pytest.raises(keras_ft.DirectoryInUseError, match="not renewed") as e:
            state.back_up(1)
        # A write error too: `on_save_error="warn"` keeps training.
        assert isinstance(e.value, keras_ft.CheckpointWriteError)
        assert [c.name for c in state.checkpoints()] == ["ckpt-00000001"]
    finally:
        monkeypatch.undo()
        state.unlock()


@ONCE
def test_two_writers_started_at_the_same_instant_never_both_hold_the_lease(
    s3_server, monkeypatch
):
    """S3's conditional writes decide: of two writers that both found the
    lease free, at the same instant or one a slow round trip later, exactly
    one holds it (the read-back scheme let a late writer win too)."""
    import threading

    from keras_ft.checkpoint import remote
    from keras_ft.checkpoint.store import open_store

    def race(delay: float) -> list[bool]:
        backup = url("race") + "/chief"
        leases = [remote.RemoteLease(open_store(backup).storage) for _ in range(2)]
        for lease in leases:
            lease._read()  # Connected before the start.
        start = threading.Barrier(2)
        won = [False, False]

        def take(i: int) -> None:
            lease = leases[i]
            if i == 1 and delay:  # Its write reaches the server late.
                write = lease._write

                def late(*args, **kwargs):
                    time.sleep(delay)
                    write(*args, **kwargs)

                lease._write = late
            start.wait()
            try:
                lease.acquire()
                won[i] = True
            except keras_ft.DirectoryInUseError:
                pass

        threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for lease in leases:
            lease.release()
        return won

    for delay in [0.0] * 20 + [0.3] * 3:
        won = race(delay)
        assert sum(won) == 1, (delay, won)


@ONCE
def test_a_heartbeat_never_writes_over_a_lease_taken_over_in_s3(s3_server, monkeypatch):
    """The first writer's heartbeat is conditional on the lease it wrote:
    once a second writer took the lapsed lease over, the first's next beat
    is refused by the server, and its next commit with it."""
    from keras_ft.checkpoint import remote
    from keras_ft.checkpoint.store import open_store
    from keras_ft.errors import LeaseLapsedError

    monkeypatch.setenv(remote.LEASE_SECONDS_ENV, "1")
    backup = url("taken") + "/chief"
    first = remote.RemoteLease(open_store(backup).storage)
    second = remote.RemoteLease(open_store(backup).storage)
    first.acquire()
    try:
        first._stop.set()  # The first stalls: no beat for a lease's time.
        first._beating.join()
        time.sleep(1.2)
        second.acquire()
        first._write(over=first._etag)  # As its next beat would.
    except remote.Refused:
        pass
    else:
        raise AssertionError("a beat wrote over the lease taken over")
    finally:
        second.check()
        assert first._read()["token"] == second._token
        first._stop.clear()
        first._beating = remote.threads.start_daemon(first._heartbeat, "beat")
        time.sleep(0.8)  # One real beat, refused.
        with pytest.raises(LeaseLapsedError, match="taken over"):
            first.check()
        assert first._read()["token"] == second._token
        first.release()
        second.release()


@ONCE
def test_a_manifest_is_never_committed_over_another(s3_server, data):
    """Two writers that picked the same checkpoint number: the second's
    manifest is refused by the server, the save says so, and the first's
    checkpoint is not deleted."""
    from keras_ft.checkpoint.store import open_store
    from keras_ft.errors import LeaseLapsedError

    backup = url("manifest") + "/chief"
    store = open_store(backup)
    first = store.save(lambda staging: staging.write_file("a.bin", [b"1"]), {})
    manifest = s3().cat_file(store.storage._key(first, "manifest.json"))
    late = open_store(backup)
    late.storage._listing = lambda: {}  # It listed before the first commit.
    with pytest.raises(LeaseLapsedError, match="committed by another writer"):
        late.save(lambda staging: staging.write_file("a.bin", [b"2"]), {})
    fs = s3()
    fs.invalidate_cache()
    assert fs.cat_file(store.storage._key(first, "manifest.json")) == manifest
    assert [c.sequence for c in store.checkpoints()] == [1]


@ONCE
@pytest.mark.parametrize("wiped", [False, True])
def test_a_cluster_resumes_from_its_local_tiers_unless_one_came_back_empty(
    s3_server, tmp_path, wiped
):
    """Two JAX processes, each with a local tier on its "own" disk, saving
    there every batch and to the bucket every 16. Killed after the first
    bucket commit, both resume from their local tiers, past the bucket's
    newest, reading no checkpoint object from the bucket (the server's
    request log says); if one process's tier was wiped (a new machine),
    both resume from the bucket."""
    args = ["--save-freq", "16", "--local-dir", str(tmp_path / "local"),
            "--kill-window", "0.6", "--seed", "0",
            "--count-bucket-reads"]  # fmt: skip
    if wiped:
        args += ["--wipe-local-of", "1"]
    run = run_cluster_on_bucket(s3_server, url("tiers"), *args)
    committed = run["committed_step"]
    assert committed == 16 and run["exit_codes"] == [0, 0], run
    resumed = run["resumed_steps"]
    assert resumed[0] == resumed[1], run
    # The server's own record of the relaunch: checkpoint objects read.
    reads = run["bucket_reads_after_relaunch"]
    if wiped:
        assert resumed[0] == committed and reads > 0, run
    else:
        assert committed < resumed[0] <= run["killed_after_step"] + 1, run
        assert reads == 0, run
    assert run["final_steps"] == [3 * 8, 3 * 8]
    assert run["weights"][0] == run["weights"][1]


@run_once_on("tensorflow", "a MultiWorkerMirroredStrategy cluster")
def test_a_tensorflow_cluster_with_a_wiped_tier_resumes_from_the_bucket(
    s3_server, tmp_path
):
    """The same under `MultiWorkerMirroredStrategy`, one worker's tier wiped:
    the workers agree on their tiers' step through the strategy's
    collectives, so both resume from the bucket (without the agreement, the
    worker whose tier survived would resume from it alone). Both tiers kept,
    the agreement is the same: the JAX test's other case."""
    args = ["--save-freq", "16", "--local-dir", str(tmp_path / "local"),
            "--kill-window", "0.6", "--seed", "0", "--count-bucket-reads",
            "--wipe-local-of", "1"]  # fmt: skip
    run = run_cluster_on_bucket(s3_server, url("tf-tiers"), *args, backend="tensorflow")
    assert run["committed_step"] == 16 and run["exit_codes"] == [0, 0], run
    assert run["resumed_steps"] == [16, 16], run
    assert run["bucket_reads_after_relaunch"] > 0, run
    assert run["final_steps"] == [3 * 8, 3 * 8]
    assert run["weights"][0] == run["weights"][1]
