"""The local tier's note of what this machine committed to the bucket: a
restore that finds the bucket's newest checkpoint noted reads nothing of it
(`keras_ft/local_tier.py`). Restores through whole trainings:
`test_worker_training_state.py`, `test_remote.py`, `test_sharded.py`."""

from __future__ import annotations

import json
import os
import time

import fsspec
import pytest

from keras_ft.checkpoint.format import Checkpoint
from keras_ft.checkpoint.store import open_store
from keras_ft.local_tier import LocalTier


def at(step: int) -> dict:
    return {"epochs_completed": 0, "batches_completed": step, "step": step}


def write(staging) -> None:
    with open(os.path.join(staging, "weights.bin"), "wb") as f:
        f.write(b"w" * 64)


@pytest.fixture
def stores(tmp_path):
    """A tier on this disk and a bucket (fsspec's in-memory one)."""
    tier = open_store(str(tmp_path / "tier"))
    bucket = open_store(f"memory://tier-note-{os.getpid()}-{time.monotonic_ns()}")
    return tier, bucket


def relaunched(tier, bucket) -> LocalTier:
    """The tier as a new process finds it (nothing remembered)."""
    return LocalTier(tier, bucket, task=None, state=None)


def hide_metadata(bucket, checkpoint: Checkpoint) -> None:
    """Removes the checkpoint's metadata from the bucket: a position found
    after this came from the note, not from a read of the bucket."""
    fs, path = fsspec.core.url_to_fs(f"{checkpoint.path}/metadata.json")
    fs.rm(path)
    assert bucket.unverified_metadata(checkpoint) == {}


def commit(tier: LocalTier, bucket, step: int, noted: bool = True) -> Checkpoint:
    """A save committed to the bucket as `TieredStore` commits one; without
    `noted`, the process is killed between the commit and its note."""
    committed = bucket.save(write, at(step), committing=tier.uploading)
    if noted:
        tier.uploaded(committed, at(step))
    return committed


@pytest.mark.parametrize("noted", [True, False], ids=["noted", "killed before"])
def test_the_bucket_newest_is_known_from_the_note(stores, noted):
    tier_store, bucket = stores
    tier = relaunched(tier_store, bucket)
    commit(tier, bucket, 3)
    newest = commit(tier, bucket, 6, noted=noted)
    hide_metadata(bucket, newest)
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 6, 6)


def test_a_commit_killed_before_the_bucket_took_it_is_not_the_newest(stores):
    """Killed after the note of a checkpoint being committed, before the
    bucket has it: the last commit is the newest, as noted."""
    tier_store, bucket = stores
    tier = relaunched(tier_store, bucket)
    first = commit(tier, bucket, 3)
    tier.uploading(Checkpoint(first.sequence + 1, "never committed"), at(6))
    hide_metadata(bucket, first)
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 3, 3)


def test_a_failed_commit_is_taken_back_from_the_note(stores):
    """A commit that failed leaves its number free: a checkpoint another
    writer commits under it is read from the bucket, not taken for the one
    this machine noted."""
    tier_store, bucket = stores
    tier = relaunched(tier_store, bucket)
    first = commit(tier, bucket, 3)
    tier.uploading(Checkpoint(first.sequence + 1, "failed"), at(6))
    tier.upload_failed()
    other = bucket.save(write, at(9))  # Another machine's commit.
    assert other.sequence == first.sequence + 1
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 9, 9)


def test_the_last_runs_note_is_kept_until_a_commit_replaces_it(stores):
    """A new run's first note of a commit keeps the last run's commit: killed
    before the bucket takes the new one, the old one is still known."""
    tier_store, bucket = stores
    first = commit(relaunched(tier_store, bucket), bucket, 3)
    hide_metadata(bucket, first)
    tier = relaunched(tier_store, bucket)
    tier.uploading(Checkpoint(first.sequence + 1, "in flight"), at(6))
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 3, 3)


def test_an_older_note_is_read(stores):
    """Written before the note named a commit in flight: its one entry is
    the last commit."""
    tier_store, bucket = stores
    newest = bucket.save(write, at(3))
    note = {"sequence": newest.sequence, "position": [0, 3, 3]}
    tier_store.replace_notice("uploaded.json", json.dumps(note).encode())
    hide_metadata(bucket, newest)
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 3, 3)


@pytest.mark.parametrize(
    "note",
    [
        b"{not json",
        b"[1]",
        b'{"committed": {"sequence": 1}}',
        b'{"committed": {"sequence": 1, "position": 3}}',
        b'{"committed": {"sequence": 1, "position": [0, 3]}}',
        b'{"committed": null, "committing": "ckpt-1"}',
    ],
)
def test_a_damaged_note_leaves_the_answer_to_the_bucket(stores, note):
    tier_store, bucket = stores
    assert bucket.save(write, at(3)).sequence == 1
    tier_store.replace_notice("uploaded.json", note)
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 3, 3)


def test_an_unwritable_note_does_not_stop_the_commit(stores, tmp_path):
    """The note is a shortcut: a tier it cannot be written to leaves it out
    of date, and the commit goes on (a restore reads the bucket's)."""
    tier_store, bucket = stores
    tier = relaunched(tier_store, bucket)
    commit(tier, bucket, 3)
    note = tmp_path / "tier" / "uploaded.json"
    note.unlink()
    os.mkdir(note)  # Replacing a directory with a file fails.
    newest = commit(tier, bucket, 6)
    assert bucket.checkpoints()[-1] == newest
    assert relaunched(tier_store, bucket)._bucket_newest() == (0, 6, 6)
