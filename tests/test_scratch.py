"""Scratch directories: removed by their process, or reaped once it is dead."""

import os
import signal
import subprocess
import sys

from keras_ft.checkpoint import scratch

# Makes a scratch directory under TMPDIR, says where, and waits to be killed.
_HOLDER = """
import sys, time
from keras_ft.checkpoint import scratch
path = scratch.make("upload")
open(path + "/arrays.h5", "wb").write(b"x" * 4096)
EXTRA
print(path, flush=True)
time.sleep(600)
"""


def start_holder(tmp_path, extra=""):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.replace("EXTRA", extra)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    return holder, holder.stdout.readline().strip()


def test_make_and_remove(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(tmp_path))
    path = scratch.make("download")
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.basename(path).startswith("keras-ft-download-")
    assert os.path.isdir(path) and os.path.isfile(path + ".lock")
    assert scratch.reap(str(tmp_path)) == []  # Held by this process.
    open(os.path.join(path, "f"), "wb").close()
    scratch.remove(path)
    assert os.listdir(tmp_path) == []


def test_a_killed_process_directory_is_reaped_and_a_live_one_kept(tmp_path):
    dead, dead_path = start_holder(tmp_path)
    alive, alive_path = start_holder(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert os.path.isdir(dead_path)  # It could not clean up.
        assert scratch.reap(str(tmp_path)) == [dead_path]
        assert not os.path.exists(dead_path)
        assert not os.path.exists(dead_path + ".lock")
        assert os.path.isfile(os.path.join(alive_path, "arrays.h5"))
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert scratch.reap(str(tmp_path)) == [alive_path]
    assert os.listdir(tmp_path) == []


def test_a_forked_child_does_not_keep_its_parent_directory(tmp_path):
    # A child the writer forked (a PyDataset worker, say) that outlives it
    # never used the directory: it must not keep it on disk.
    # The child says when it runs (its at-fork hooks have run) before the
    # parent is killed: a loaded machine may schedule it late.
    parent, path = start_holder(
        tmp_path,
        "import os\nr, w = os.pipe()\nif os.fork() == 0:\n"
        "    os.write(w, b'1')\n    time.sleep(600)\nos.read(r, 1)"
        f"\n# forked under {tmp_path}",  # For pkill, below: this test's only.
    )
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    try:
        assert scratch.reap(str(tmp_path)) == [path]
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"forked under {tmp_path}"])


def test_reap_leaves_what_is_not_a_scratch_directory(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_bytes(b"keep")
    # A planted free lock beside a symlink to someone's directory, and one
    # beside a file: neither is followed nor removed.
    (tmp_path / "keras-ft-upload-planted.lock").write_bytes(b"")
    os.symlink(precious, tmp_path / "keras-ft-upload-planted")
    (tmp_path / "keras-ft-part-file.lock").write_bytes(b"")
    (tmp_path / "keras-ft-part-file").write_bytes(b"mine")
    (tmp_path / "keras-ft-download-nolock").mkdir()
    assert scratch.reap(str(tmp_path)) == []
    assert (precious / "data").read_bytes() == b"keep"
    assert (tmp_path / "keras-ft-part-file").read_bytes() == b"mine"
    assert (tmp_path / "keras-ft-download-nolock").is_dir()
