"""Shared fixtures: small real models, synthetic data, real subprocesses."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def _share_jax_compilations() -> None:
    """JAX compiles the same small programs again in each of the suite's
    hundreds of processes (a train step, keras-ft's copies): its persistent
    cache, keyed by the program, compiles each once per pytest process and
    the subprocesses it starts (they inherit the environment). Only the
    suite's speed changes: a cached executable is the compiled program.
    A size bound turns on JAX's lock around each entry's read and write, so
    no process reads one that another is writing."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # A test's own subprocess, or the caller's choice.
    where = tempfile.mkdtemp(prefix="keras-ft-tests-jax-cache-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    os.environ.update({
        "JAX_COMPILATION_CACHE_DIR": where,
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(2**31),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    })  # fmt: skip


_share_jax_compilations()  # Before JAX is imported (by Keras).

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TRAIN_SCRIPT = os.path.join(TESTS_DIR, "train_script.py")
# The examples the tests run (and their helpers, imported by the tests).
sys.path.insert(0, os.path.join(os.path.dirname(TESTS_DIR), "examples"))
from local_cluster import free_ports  # noqa: E402

SAMPLES, BATCH_SIZE = 64, 16
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE


# A test past this many seconds that has run no subprocess for the last
# NO_CHILD_SECONDS is stalled, not slow: its stacks, the machine's load and
# the busiest processes go to the terminal once, to say what it waits for.
STALL_SECONDS, NO_CHILD_SECONDS = 30.0, 10.0
_TERMINAL_FD: int | None = None


def pytest_configure(config):
    global _TERMINAL_FD
    _TERMINAL_FD = os.dup(2)  # Before any test's output is captured.


def pytest_runtest_logstart(nodeid, location):
    # A pytest process that dies (a segfault in a backend's native code)
    # prints no summary: .ci/suites names the test it died in from this file.
    path = os.environ.get("KERAS_FT_TEST_NOW")
    if path:
        with open(path, "w") as f:
            f.write(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    # TensorFlow keeps what every fit() traced (about 6,000 objects a fit,
    # with or without keras-ft), so a suite's heap grows by millions, and
    # each full collection walked all of it again: seconds each, 60-90 s of
    # a TensorFlow suite, and tests that read as stalled. What outlives a
    # test, once its garbage is collected, is left out of later collections,
    # which then walk only what later tests make.
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    # The process's last collection, which ran after pytest's summary: a
    # TensorFlow suite beside another once took two minutes more to exit.
    # Collected here, under the stall watch, it says what it waits for.
    done = threading.Event()

    def watch() -> None:
        if not done.wait(STALL_SECONDS) and _TERMINAL_FD is not None:
            _report_stall("the collection at the end of the session", STALL_SECONDS)

    threading.Thread(target=watch, daemon=True, name="stall-watch").start()
    gc.collect()
    done.set()


def _has_children() -> bool:
    # A test that waits for a job SLURM runs: the tasks are slurmd's.
    if _slurm_steps_running():
        return True
    pid = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True  # Not Linux: never call a test stalled.
    for task in tasks:
        with (
            contextlib.suppress(OSError),
            open(f"/proc/{pid}/task/{task}/children") as f,
        ):
            if f.read().strip():
                return True
    return False


def _slurm_steps_running() -> bool:
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/comm") as f:
            if f.read().startswith("slurmstepd"):
                return True
    return False


def _report_stall(name: str, seconds: float) -> None:
    lines = [f"\n=== stalled: {name} has run {seconds:.0f} s with no subprocess"]
    for path in ["/proc/loadavg"] + [f"/proc/pressure/{r}" for r in ("cpu", "io")]:
        with contextlib.suppress(OSError), open(path) as f:
            lines.append(f"{path}: " + " | ".join(f.read().split("\n")).strip(" |"))
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        ps = ["ps", "-eo", "pid,ppid,stat,etime,pcpu,rss,args", "--sort=-pcpu"]
        out = subprocess.run(ps, capture_output=True, text=True, timeout=10).stdout
        lines += [line[:200] for line in out.splitlines()[:12]]
    os.write(_TERMINAL_FD, ("\n".join(lines) + "\n").encode())
    faulthandler.dump_traceback(file=_TERMINAL_FD, all_threads=True)
    # The native stacks: stalls seen in CI had the main thread in Python's
    # garbage collector, below any Python frame, finalizing an abandoned
    # generator whose traceback held a tf.data iterator, and waiting in the
    # iterator's destructor for one of its threads, with the machine idle.
    # So: the main thread, every tf.data thread, and which generator and
    # frames are being finalized.
    out = _gdb(["thread apply all bt 40"], seconds=120)
    report = ["=== native stacks (the main thread and tf.data's):"]
    for thread in out.split("\nThread ")[1:]:
        frames = [x[:240] for x in thread.splitlines() if x.startswith("#")]
        if thread.startswith("1 ") or "tensorflow::data::" in thread:
            report += ["Thread " + thread.splitlines()[0]] + frames
    report += _finalized_python_objects(out)
    os.write(_TERMINAL_FD, ("\n".join(report) + "\n").encode())


def _gdb(commands: list[str], seconds: float) -> str:
    """What gdb prints for `commands` run in this process. While attached,
    gdb stops every thread of this process, this one included: its output
    goes to a file (a pipe this thread cannot drain would block gdb, and
    with it the process, for good), and `timeout`, outside the process,
    bounds it (TERM first: gdb then detaches as it does at the end of a batch;
    KILL ten seconds later, and the kernel detaches it). The commands only
    read memory: gdb resumes nothing in this process and plants no
    breakpoint in it."""
    command = ["timeout", "-k", "10", str(seconds), "gdb", "-p", str(os.getpid()),
               "-batch", "-nx"]  # fmt: skip
    for line in commands:
        command += ["-ex", line]
    with (
        contextlib.suppress(OSError, subprocess.SubprocessError),
        tempfile.TemporaryFile("w+") as out,
    ):
        subprocess.run(command, stdout=out, stderr=subprocess.DEVNULL)
        out.seek(0)
        return out.read()
    return ""


def _finalized_python_objects(stacks: str) -> list[str]:
    """Names the generators and frames the collector is finalizing in
    `stacks` (gdb's), read from the stalled process's memory."""
    import re

    code = {
        "_PyGen_Finalize (self=": "((struct _PyInterpreterFrame*)"
        "((PyGenObject*){})->gi_iframe)->f_code",
        "frame_dealloc (f=": "((PyFrameObject*){})->f_frame->f_code",
    }
    commands, found = [], []
    for marker, expression in code.items():
        for address in re.findall(re.escape(marker) + r"(0x[0-9a-f]+)", stacks):
            f = expression.format(address)
            found.append(marker.split(" ")[0] + " " + address)
            # Each object's values after a line of its own: a print that
            # fails (freed memory) leaves the others where they belong.
            # Read, never called: a function gdb calls runs in the stopped
            # process without its GIL (and a fault in it is left pending there
            # when gdb detaches), so each name is read as the compact ASCII
            # string CPython stores it as.
            commands += ["echo @@\\n",
                         f"p (char*)((PyASCIIObject*)({f}->co_qualname) + 1)",
                         f"p (char*)((PyASCIIObject*)({f}->co_filename) + 1)",
                         f"p {f}->co_firstlineno"]  # fmt: skip
    if not found:
        return []
    parts = _gdb(commands, seconds=60).split("@@\n")[1:]
    named = []
    for what, part in zip(found, parts, strict=False):
        values = [x.split("=", 1)[1].strip() for x in part.splitlines() if x[:1] == "$"]
        named.append(f"being finalized: {what} " + " ".join(values))
    return named


@pytest.fixture(autouse=True)
def _watch_for_a_stall(request):
    done = threading.Event()
    start = time.monotonic()

    def watch() -> None:
        if done.wait(STALL_SECONDS) or _TERMINAL_FD is None:
            return
        quiet_since = time.monotonic()
        while not done.wait(1.0):
            if _has_children():
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= NO_CHILD_SECONDS:
                _report_stall(request.node.nodeid, time.monotonic() - start)
                return

    threading.Thread(target=watch, daemon=True, name="stall-watch").start()
    yield
    done.set()


def make_model(units: int = 8, built: bool = True) -> keras.Model:
    """A small MLP with Adam; `built=False` leaves it without an Input."""
    layers = [keras.layers.Dense(units, activation="relu"), keras.layers.Dense(1)]
    if built:
        layers.insert(0, keras.Input((4,)))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    return model


def checkpoint_entries(backup_dir: str) -> list[str]:
    """The chief's directory, sorted, without the run's goodput records."""
    chief = os.path.join(backup_dir, "chief")
    return sorted(n for n in os.listdir(chief) if not n.startswith("goodput_"))


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) + 0.1).astype("float32")
    return x, y


class CrashAt(keras.callbacks.Callback):
    """Raises after batch 5 of epoch 1 (0-based epochs): an in-process crash
    for the resume tests that need no killed process."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == (1, 5):
            raise RuntimeError("crash")


def locked_training(backup_dir: str, **kwargs):
    """A `WorkerTrainingState` of a model trained one epoch, holding the
    backup's lock (`close()` it); `kwargs` go to it."""
    import keras_ft

    model = make_model()
    model.fit(*make_data(), epochs=1, batch_size=BATCH_SIZE, verbose=0)
    state = keras_ft.WorkerTrainingState(model, backup_dir, **kwargs)
    state.lock()
    return state


def iterations(model: keras.Model) -> int:
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def weights_of(model: keras.Model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v) for v in model.weights]


def tree_digest(path: str) -> dict[str, str]:
    """SHA-256 of every file below `path`, to show a backup was not touched.

    The lock file is left out: it notes who trains now, not what was saved.
    """
    digests = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name == ".lock":
                continue
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                digests[os.path.relpath(full, path)] = hashlib.sha256(
                    f.read()
                ).hexdigest()
    return digests


# Why a variant of a per-backend test runs on one backend only: the variants
# differ in what does not depend on the backend, and each backend runs one.
SPREAD = "a variant spread over the backends (each runs one)"


def run_once_on(backend: str, why: str) -> pytest.MarkDecorator:
    """Runs a test in one backend's suite only: what it checks does not
    depend on the backend, and it is slow (processes, servers, kernels)."""
    return pytest.mark.skipif(
        keras.backend.backend() != backend, reason=f"{why}; run once, on {backend}"
    )


def run_two_processes(script: str, env: dict, timeout: float = 120) -> list[dict]:
    """Runs `script` as processes 0 and 1 of a cluster (argv: index, a free
    port on 127.0.0.1); the `RESULT` line each prints, as JSON."""
    port = str(free_port())
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(i), port], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]  # fmt: skip
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=timeout)
        assert process.returncode == 0, out[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return results


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["KERAS_BACKEND"] = keras.backend.backend()
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = os.path.dirname(TESTS_DIR)
    return env


def start_training(*args: str) -> subprocess.Popen:
    """Starts `train_script.py` in a new process; events arrive on stdout."""
    return subprocess.Popen(
        [sys.executable, TRAIN_SCRIPT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def read_events(process: subprocess.Popen, until: str | None = None) -> list[dict]:
    """Reads the script's JSON events, up to one of kind `until` or the end."""
    events = []
    for line in process.stdout:
        if line.startswith("EVENT "):
            event = json.loads(line[len("EVENT ") :])
            events.append(event)
            if event["kind"] == until:
                break
    return events


def run_training(*args: str, timeout: float = 180) -> tuple[int, list[dict], str]:
    process = start_training(*args)
    events = read_events(process)
    stderr = process.stderr.read()
    return process.wait(timeout=timeout), events, stderr


@pytest.fixture(autouse=True)
def _isolated_signal_handlers():
    """Each test starts with the handlers the suite started with.

    A `fit()` that raises leaves keras-ft's handlers installed (Keras calls
    no callback then); they step aside at the next signal, which
    `test_preemption.py` tests. Other tests should not depend on that.
    """
    signals = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in signals}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.fixture
def data():
    return make_data()


@pytest.fixture
def backup_dir(tmp_path):
    return str(tmp_path / "backup")


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot write, even as root."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield str(path)
        path.chmod(0o755)
        return
    # Root ignores permission bits; a read-only mount stops it.
    with mounted_tmpfs(path, "ro,size=1m"):
        yield str(path)


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 2 MB filesystem (tmpfs) that tests can fill or make read-only."""
    path = tmp_path / "small_fs"
    path.mkdir()
    with mounted_tmpfs(path, "size=2m"):
        yield str(path)


@contextlib.contextmanager
def mounted_tmpfs(path, options: str):
    """Mounts a tmpfs at `path` for the block; skips the test if not allowed."""
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {mounted.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_filesystem(directory: str) -> str:
    """Writes a file until the filesystem is full; returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == 28, e
    try:
        while True:
            os.write(fd, b"\0")
    except OSError:
        pass
    os.close(fd)
    return path


# A real S3-protocol server (moto) on loopback, for the bucket tests.
BUCKET = "keras-ft-test"


def backup_deleted(backup_dir: str) -> bool:
    """Whether a finished run deleted its backup: `backup_dir` is gone, as
    Keras' own tests require (the goodput record went to its logger)."""
    return not os.path.exists(backup_dir)


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, outside the range the
    kernel hands to outbound connections (`local_cluster.free_ports()`)."""
    return free_ports(1)[0]


def start_moto() -> tuple[subprocess.Popen, int]:
    """A moto S3 server on a free loopback port, once it accepts connections."""
    port = free_port()
    # Beside this Python, or on the PATH (a lane's venv that borrows the
    # test venv's packages, .ci/compat).
    moto = shutil.which(
        "moto_server", path=os.path.dirname(sys.executable)
    ) or shutil.which("moto_server")
    # Its request recorder (when a test starts it) writes here, not in the
    # working directory; removed when this process ends.
    scratch = tempfile.mkdtemp(prefix="keras-ft-moto-")
    atexit.register(shutil.rmtree, scratch, True)
    recording = os.path.join(scratch, "requests")
    server = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, MOTO_RECORDER_FILEPATH=recording),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on loopback; the environment points fsspec at it."""
    server, port = start_moto()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    # fsspec keeps filesystems by their options, not the environment: one
    # made for another module's server would still point at that one.
    fs_class = fsspec.get_filesystem_class("s3")
    fs_class.clear_instance_cache()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    fs_class.clear_instance_cache()
    server.terminate()
    server.wait(timeout=30)
