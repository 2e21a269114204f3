"""A backup on a disk (`keras_ft/checkpoint/local.py`): a retired
checkpoint's big file lent to the next save (only a file this store wrote,
and none a reader holds), and a finished backup moved out to be removed in
the background (this user's trash, or beside `backup_dir`). The store over
any storage: `test_store.py`."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading

from test_store import write_payload

import keras_ft
from keras_ft import threads
from keras_ft.checkpoint import local
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.training.policy import KeepLast


def write_big(content: bytes):
    def write(staging):
        staging.write_file("big.bin", [content])

    return write


def inode(path: str) -> int:
    return os.stat(path).st_ino


def test_a_checkpoint_let_go_lends_its_big_file_to_the_next_save(tmp_path):
    store = CheckpointStore(str(tmp_path), KeepLast(1))
    contents = [os.urandom(3 << 20) for _ in range(3)]
    first = store.save(write_big(contents[0]), {})
    first_inode = inode(first.file("big.bin"))
    store.save(write_big(contents[1]), {})  # First is now the spare,
    third = store.save(write_big(contents[2]), {})  # written over here.
    assert inode(third.file("big.bin")) == first_inode
    with open(third.file("big.bin"), "rb") as f:
        assert f.read() == contents[2]
    store.verify(third)
    threads.wait_for_removals()
    names = sorted(os.listdir(tmp_path))
    assert names[1:] == [third.name] and names[0].startswith(".spare-")


def test_a_smaller_file_written_over_a_spare_is_cut_to_size(tmp_path):
    store = CheckpointStore(str(tmp_path), KeepLast(1))
    store.save(write_big(os.urandom(4 << 20)), {})
    store.save(write_big(os.urandom(4 << 20)), {})
    smaller = os.urandom((2 << 20) + 5)
    checkpoint = store.save(write_big(smaller), {})
    with open(checkpoint.file("big.bin"), "rb") as f:
        assert f.read() == smaller
    store.verify(checkpoint)


def test_a_file_a_reader_holds_is_never_written_over(tmp_path):
    import fcntl

    store = CheckpointStore(str(tmp_path), KeepLast(1))
    original = os.urandom(3 << 20)
    first = store.save(write_big(original), {})
    with open(first.file("big.bin"), "rb") as reader:
        fcntl.flock(reader.fileno(), fcntl.LOCK_SH)  # As a loader holds it.
        for _ in range(3):
            newest = store.save(write_big(os.urandom(3 << 20)), {})
            assert inode(newest.file("big.bin")) != os.fstat(reader.fileno()).st_ino
        assert reader.read() == original
    store.verify(newest)


def test_only_a_file_the_store_wrote_is_written_over(tmp_path):
    """A file put in a checkpoint by someone else (here: moved in while its
    owner keeps it open, so that it has one link and no other name) is not
    overwritten when that checkpoint is recycled: its owner would see it."""
    store = CheckpointStore(str(tmp_path / "chief"), KeepLast(1))
    first = store.save(write_big(os.urandom(3 << 20)), {})
    planted = tmp_path / "planted.bin"
    original = os.urandom(3 << 20)
    planted.write_bytes(original)
    with open(planted, "rb") as owner:
        os.replace(planted, first.file("big.bin"))
        assert os.fstat(owner.fileno()).st_nlink == 1
        for _ in range(3):
            newest = store.save(write_big(os.urandom(3 << 20)), {})
            assert inode(newest.file("big.bin")) != os.fstat(owner.fileno()).st_ino
        assert owner.read() == original
    store.verify(newest)


def _held_removal(monkeypatch) -> threading.Event:
    """keras-ft's background removals, held until the event is set (a slow
    disk); any other `shutil.rmtree` (the user's) runs at once."""
    release = threading.Event()
    rmtree = shutil.rmtree

    def held(path, *args, **kwargs):
        if threading.current_thread().name == "keras-ft-discard":
            assert release.wait(30)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held)
    return release


def _finished_store(backup) -> CheckpointStore:
    store = CheckpointStore(str(backup / "chief"), KeepLast(3))
    for i in range(3):
        store.save(write_payload(bytes([i]) * 1000), {})
    os.mkdir(backup / "chief" / ".staging-00000009-1-abcd")
    return store


_MOVED = [".staging-00000009-1-abcd", "ckpt-00000001", "ckpt-00000002", "ckpt-00000003"]


def test_clear_moves_everything_to_the_trash_and_removes_it_later(
    tmp_path, monkeypatch
):
    """fit()'s end does not wait for the disk: the checkpoints leave the
    backup in one rename each, into this user's trash in the temporary
    directory (on this filesystem), and their removal is not waited for.
    Nothing appears beside the backup: the user removing the directory that
    holds it, right after fit(), does not race the removal."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    parent = tmp_path / "work"
    backup = parent / "backup"
    store = _finished_store(backup)
    release = _held_removal(monkeypatch)
    store.clear(beside=str(backup))
    assert os.listdir(parent) == ["backup"] and os.listdir(backup) == []
    trash = tmp_path / "tmp" / f"keras-ft-trash-{os.getuid()}"
    assert stat.S_IMODE(os.lstat(trash).st_mode) == 0o700
    (moved,) = os.listdir(trash)
    assert moved.startswith("deleted-") and sorted(os.listdir(trash / moved)) == _MOVED
    shutil.rmtree(parent)  # The user's, while the removal is held: no race.
    release.set()
    threads.wait_for_discards()
    assert os.listdir(trash) == []


def test_clear_moves_everything_beside_the_backup_where_the_trash_is_refused(
    tmp_path, monkeypatch
):
    """A trash name that is a link (or another user's) is not used: the
    checkpoints wait beside the backup instead, and are still removed later."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(
        tmp_path / "elsewhere", tmp_path / "tmp" / f"keras-ft-trash-{os.getuid()}"
    )
    backup = tmp_path / "backup"
    (tmp_path / "theirs").mkdir()  # Beside the backup: not keras-ft's.
    store = _finished_store(backup)
    release = _held_removal(monkeypatch)
    store.clear(beside=str(backup))
    assert not os.path.exists(backup / "chief")
    (moved,) = [n for n in os.listdir(tmp_path) if n.startswith(".backup.")]
    assert sorted(os.listdir(tmp_path / moved)) == _MOVED
    release.set()
    keras_ft.wait_for_backups()  # The public wait includes the removal.
    assert sorted(os.listdir(tmp_path)) == ["backup", "elsewhere", "theirs", "tmp"]
    assert os.listdir(backup) == []  # `backup_dir` itself: the claim's to remove.
    assert os.listdir(tmp_path / "elsewhere") == []


def test_what_a_killed_removal_left_goes_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    trash = tmp_path / "tmp" / f"keras-ft-trash-{os.getuid()}"
    (trash / "deleted-0123456789ab" / "ckpt-00000001").mkdir(parents=True)
    (trash / "theirs").mkdir()  # Not a name keras-ft gives.
    backup = tmp_path / "backup"
    left = tmp_path / ".backup.keras-ft-deleted-0123456789ab"
    (left / "ckpt-00000001").mkdir(parents=True)
    (left / "ckpt-00000001" / "weights.bin").write_bytes(b"x" * 100)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.symlink(outside, tmp_path / ".backup.keras-ft-deleted-feedfeedfeed")
    other = tmp_path / ".other.keras-ft-deleted-0123456789ab"  # Another backup's.
    other.mkdir()
    local.sweep_discarded(str(backup))
    threads.wait_for_discards()
    assert not left.exists() and other.exists()
    assert os.listdir(trash) == ["theirs"]
    assert (outside / "keep.txt").read_text() == "mine"  # A link: not followed.
