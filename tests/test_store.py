"""CheckpointStore: atomic commit, verification, fallback, retention."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import run_once_on, tree_digest

from keras_ft import threads
from keras_ft.checkpoint import format as format_module
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.errors import CorruptCheckpointError, NoGoodCheckpointError
from keras_ft.training.policy import KeepLast


def write_payload(content: bytes):
    def write(directory):
        with open(os.path.join(directory, "payload.bin"), "wb") as f:
            f.write(content)

    return write


def payload(checkpoint) -> bytes:
    with open(checkpoint.file("payload.bin"), "rb") as f:
        return f.read()


def test_save_commits_a_verifiable_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path / "chief"))
    checkpoint = store.save(write_payload(b"abc"), {"epoch": 3})
    assert checkpoint.name == "ckpt-00000001"
    assert store.verify(checkpoint) == {"epoch": 3}
    assert sorted(os.listdir(checkpoint.path)) == [
        "manifest.json",
        "metadata.json",
        "payload.bin",
    ]
    assert os.listdir(store.directory) == ["ckpt-00000001"]


def test_sequence_numbers_increase_and_latest_is_newest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for i in range(3):
        store.save(write_payload(bytes([i])), {"i": i})
    checkpoint, metadata = store.latest_good()
    assert checkpoint.sequence == 3 and metadata == {"i": 2}
    assert [c.sequence for c in store.checkpoints()] == [1, 2, 3]


def test_empty_store_has_no_latest(tmp_path):
    assert CheckpointStore(str(tmp_path / "missing")).latest_good() is None


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def damage_manifest(path):
    manifest_path = os.path.join(os.path.dirname(path), "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"]["payload.bin"]["size"] += 1
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def write_garbage_manifest(path):
    with open(os.path.join(os.path.dirname(path), "manifest.json"), "w") as f:
        f.write("{not json")


DAMAGES = {
    "flipped byte": (flip_byte, "XXH3-128 checksum"),
    "truncated": (truncate, "truncated"),
    "deleted": (os.remove, "missing"),
    "manifest edited": (damage_manifest, "digest"),
    "manifest garbage": (write_garbage_manifest, "not valid JSON"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_falls_back_to_previous_with_warning(tmp_path, damage):
    store = CheckpointStore(str(tmp_path))
    store.save(write_payload(os.urandom(1000)), {"i": 1})
    newest = store.save(write_payload(os.urandom(1000)), {"i": 2})
    corrupt, reason = DAMAGES[damage]
    corrupt(newest.file("payload.bin"))
    with pytest.raises(CorruptCheckpointError, match=reason):
        store.verify(newest)
    with pytest.warns(UserWarning, match=reason):
        checkpoint, metadata = store.latest_good()
    assert checkpoint.sequence == 1 and metadata == {"i": 1}
    # The damaged one stays for inspection.
    assert os.path.isdir(newest.path)


def test_no_good_checkpoint_is_a_clear_error_and_deletes_nothing(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for i in range(2):
        checkpoint = store.save(write_payload(b"x" * 100), {"i": i})
        truncate(checkpoint.file("payload.bin"))
    before = tree_digest(str(tmp_path))
    with (
        pytest.warns(UserWarning),
        pytest.raises(
            NoGoodCheckpointError,
            match="None of the 2 checkpoints.*nothing was deleted",
        ),
    ):
        store.latest_good()
    assert tree_digest(str(tmp_path)) == before


def test_big_files_are_written_from_buffers_and_checksummed_on_the_way(tmp_path):
    store = CheckpointStore(str(tmp_path))
    parts = [os.urandom(3 << 20), np.arange(1 << 20, dtype="float32"), b"", b"end"]

    def write(staging):
        staging.write_file("big.bin", [memoryview(p) for p in parts])

    checkpoint = store.save(write, {})
    with open(checkpoint.file("big.bin"), "rb") as f:
        assert f.read() == b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    store.verify(checkpoint)
    flip_byte(checkpoint.file("big.bin"))  # Past 4 MB: verified through a map.
    with pytest.raises(CorruptCheckpointError, match="big.bin does not match"):
        store.verify(checkpoint)


def rewrite_manifest(checkpoint, change):
    with open(checkpoint.file("manifest.json")) as f:
        manifest = json.load(f)
    change(manifest)
    body = {k: v for k, v in manifest.items() if k not in ("digest", "signature")}
    manifest["digest"] = format_module._json_digest(body)
    with open(checkpoint.file("manifest.json"), "w") as f:
        json.dump(manifest, f)


def test_manifest_cannot_point_outside_the_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    checkpoint = store.save(write_payload(b"x"), {})
    (tmp_path / "secret").write_text("s")
    manifest_path = checkpoint.file("manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"]["../secret"] = {"size": 1, "sha256": "0" * 64}
    body = {k: v for k, v in manifest.items() if k != "digest"}
    manifest["digest"] = format_module._json_digest(body)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint"):
        store.verify(checkpoint)


def test_retention_keeps_the_newest_n(tmp_path):
    store = CheckpointStore(str(tmp_path), KeepLast(2))
    for i in range(5):
        store.save(write_payload(bytes([i])), {"i": i})
    assert [c.sequence for c in store.checkpoints()] == [4, 5]
    threads.wait_for_removals()  # Deleted ones go in the background.
    # No spare is kept of checkpoints this small: nothing to reuse.
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004", "ckpt-00000005"]


def test_a_superseding_checkpoint_takes_no_older_ones_place(tmp_path):
    store = CheckpointStore(str(tmp_path), KeepLast(2))
    older = store.save(write_payload(b"older"), {"i": 0})
    first = store.save(write_payload(b"first"), {"i": 1})
    replacing = store.save(write_payload(b"more"), {"i": 1}, supersedes=first)
    # Deleted before retention ran: the older one is still the fallback.
    assert store.checkpoints() == [older, replacing]
    assert store.latest_good() == (replacing, {"i": 1})
    # A superseded save that never committed: nothing more is deleted.
    last = store.save(write_payload(b"last"), {"i": 2}, supersedes=None)
    assert store.checkpoints() == [replacing, last]


def test_failed_write_leaves_previous_checkpoint_and_no_staging(tmp_path):
    store = CheckpointStore(str(tmp_path), KeepLast(1))
    store.save(write_payload(b"good"), {"i": 1})

    def failing_write(directory):
        write_payload(b"partial")(directory)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        store.save(failing_write, {"i": 2})
    assert os.listdir(tmp_path) == ["ckpt-00000001"]
    checkpoint, metadata = store.latest_good()
    assert payload(checkpoint) == b"good" and metadata == {"i": 1}


def test_clear_removes_only_what_the_store_made(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    store = CheckpointStore(str(tmp_path))
    store.save(write_payload(b"x"), {})
    os.mkdir(tmp_path / ".staging-00000009-1-abcd")
    store.clear()
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_clear_removes_the_directory_when_empty(tmp_path):
    store = CheckpointStore(str(tmp_path / "chief"))
    store.save(write_payload(b"x"), {})
    store.clear()
    assert not os.path.exists(tmp_path / "chief")


# The child imports keras_ft.checkpoint, which needs no Keras, so it starts
# in milliseconds and the test can afford many kills.
_WRITER = textwrap.dedent(
    """
    import os, sys
    from keras_ft.checkpoint import store as store_module
    assert "keras" not in sys.modules

    class KeepTwo:
        def select_for_deletion(self, checkpoints):
            return list(checkpoints[:-2])

    store = store_module.CheckpointStore(sys.argv[1], KeepTwo())
    store.remove_leftovers()
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        data = os.urandom(4 * 1024 * 1024)
        def write(d):
            d.write_file("a.bin", [data])  # Over the spare's, from the third on.
            with open(os.path.join(d, "b.bin"), "wb") as f:
                f.write(data)
        store.save(write, {"i": i})
    """
)


@run_once_on("torch", "the store alone, in processes that import no backend")
def test_sigkill_at_random_moments_always_leaves_a_verifiable_checkpoint(tmp_path):
    directory = str(tmp_path / "chief")
    rng = random.Random(1234)
    for _ in range(25):
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, directory],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        store = CheckpointStore(directory)
        found = store.latest_good()
        if found is None:
            assert not store.checkpoints()
            continue
        checkpoint, metadata = found
        for c in store.checkpoints():
            store.verify(c)  # Every committed checkpoint is whole.
        with (
            open(checkpoint.file("a.bin"), "rb") as a,
            open(checkpoint.file("b.bin"), "rb") as b,
        ):
            assert a.read() == b.read()
    assert store.checkpoints(), "no kill landed after a commit in 25 tries"


def test_only_exact_checkpoint_names_are_checkpoints(tmp_path):
    """Names a careless or hostile writer left beside the checkpoints are not
    taken for them: another digit set, a trailing newline, extra leading
    zeros, a number too long, a symlink to a directory elsewhere."""
    store = CheckpointStore(str(tmp_path / "chief"))
    good = store.save(lambda staging: None, {"i": 1})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    odd = [
        "ckpt-\u0669\u0669\u0669\u0669\u0669\u0669\u0669\u0669",  # Arabic-Indic 9s.
        "ckpt-99999999\n",
        "ckpt-000000099",
        "ckpt-" + "9" * 250,
    ]
    for name in odd:
        os.mkdir(os.path.join(store.directory, name))
    os.symlink(elsewhere, os.path.join(store.directory, "ckpt-99999998"))
    assert store.checkpoints() == [good]
    # The next save is numbered after the real one, and nothing was followed.
    assert store.save(lambda staging: None, {"i": 2}).name == "ckpt-00000002"
    assert list(elsewhere.iterdir()) == []


def test_with_a_manifest_key_only_checkpoints_signed_with_it_are_trusted(tmp_path):
    """Someone who can write the directory but has not the key commits a
    newer checkpoint (a re-sealed copy of a signed one, or an unsigned one):
    it is refused as damaged and the newest signed one is restored."""
    key = "a-secret"
    store = CheckpointStore(str(tmp_path), manifest_key=key)
    signed = store.save(write_payload(b"good"), {"i": 1})
    with open(signed.file("manifest.json")) as f:
        signature = json.load(f)["signature"]
    assert signature
    assert store.verify(signed) == {"i": 1}

    forged = CheckpointStore(str(tmp_path)).save(write_payload(b"evil"), {"i": 2})
    with pytest.warns(UserWarning, match="not signed"):
        assert store.latest_good() == (signed, {"i": 1})

    # The forger copies the signature onto its own manifest.
    def copy_signature(manifest):
        manifest["signature"] = signature

    rewrite_manifest(forged, copy_signature)
    with pytest.raises(CorruptCheckpointError, match="signature does not match"):
        store.verify(forged)
    with pytest.raises(CorruptCheckpointError, match="signature does not match"):
        CheckpointStore(str(tmp_path), manifest_key="another").verify(signed)
    # Without a key, signatures are not asked for (nor checked).
    assert CheckpointStore(str(tmp_path)).verify(forged) == {"i": 2}


def test_the_manifest_key_comes_from_the_environment(tmp_path, monkeypatch):
    CheckpointStore(str(tmp_path)).save(write_payload(b"x"), {})
    monkeypatch.setenv("KERAS_FT_MANIFEST_KEY", "from-env")
    with pytest.raises(NoGoodCheckpointError, match="not signed"):
        CheckpointStore(str(tmp_path)).latest_good()
    signed = CheckpointStore(str(tmp_path)).save(write_payload(b"y"), {"i": 3})
    monkeypatch.delenv("KERAS_FT_MANIFEST_KEY")
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        CheckpointStore(str(tmp_path), manifest_key="other").verify(signed)


@pytest.mark.parametrize("key", ["", b"", 42])
def test_a_bad_manifest_key_is_named(tmp_path, key):
    with pytest.raises(ValueError, match="argument `manifest_key`"):
        CheckpointStore(str(tmp_path), manifest_key=key)
