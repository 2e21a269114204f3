"""The chief's store and the local tier in front of a bucket
(`keras_ft/saves/tiers.py`): a save committed to the tier, then to the
bucket, the tier's note of the bucket commit written before it happens; and
the error of a save the processes disagree on. Restores from the tiers:
`test_local_tier.py`, `test_worker_training_state.py`."""

from __future__ import annotations

import json
import os
import time
import types

import pytest
from conftest import make_data, make_model

import keras_ft
from keras_ft.checkpoint.store import open_store
from keras_ft.errors import CheckpointWriteError, ProcessesDisagreeError
from keras_ft.saves.save import Save
from keras_ft.saves.tiers import TieredStore
from keras_ft.training.policy import KeepLast


def test_a_save_the_processes_disagree_on_fails_as_a_write_naming_the_fix(tmp_path):
    """Processes that disagree raise no OSError (no errno): the save still
    fails as a `CheckpointWriteError` that says what is intact and what
    to do."""
    model = make_model()
    model.fit(*make_data(), epochs=1, verbose=0)
    state = keras_ft.WorkerTrainingState(model, str(tmp_path))
    first = state.back_up(0)
    store = open_store(str(tmp_path / "chief"), KeepLast(2))
    tiers = TieredStore(store, store.writer_lock())
    error = tiers.write_failed(ProcessesDisagreeError("Processes [1] did not write"))
    assert isinstance(error, CheckpointWriteError) and error.errno is None
    text = str(error)
    assert "Processes [1] did not write" in text
    assert f"the previous checkpoint {first.name} is intact" in text
    assert "Relaunch every process of the training together" in text


class Weights:
    """A save's files, laid out as a record of its own (`SaveFiles`)."""

    @staticmethod
    def write(staging) -> None:
        with open(os.path.join(staging, "weights.bin"), "wb") as f:
            f.write(b"w" * 1000)


def at(step: int) -> dict:
    return {"epochs_completed": 0, "batches_completed": step, "step": step}


@pytest.fixture
def tiered(tmp_path):
    """A local tier on this disk in front of a bucket (fsspec's in-memory one)."""
    from keras_ft.local_tier import LocalTier

    bucket = open_store(f"memory://tiers-{os.getpid()}-{time.monotonic_ns()}/chief")
    local = open_store(str(tmp_path / "tier"))
    tier = LocalTier(local, bucket, task=None, state=None)
    return TieredStore(bucket, bucket.writer_lock(), local, tier)


def note(tiers) -> dict:
    return json.loads(tiers.local.read_notice("uploaded.json"))


def commit(tiers, step: int):
    # What a save's record carries here: its metadata, and how its files are
    # written.
    save = Save(types.SimpleNamespace(metadata=at(step)), Weights(), to_bucket=True)
    return tiers.commit(save, lock=None)


def test_a_save_is_committed_to_the_tier_then_copied_to_the_bucket(tiered):
    committed = commit(tiered, 3)
    assert committed.path.startswith("memory://")
    (local,) = tiered.local.checkpoints()
    tiered.backup.verify(committed)
    assert (
        tiered.backup.manifest(committed)["weights.bin"]
        == (tiered.local.manifest(local)["weights.bin"])
    )
    assert note(tiered) == {"committed": {"sequence": 1, "position": [0, 3, 3]}}


def test_the_tier_names_a_bucket_commit_before_it_happens(tiered, monkeypatch):
    """Killed between the bucket's commit and the note of it, a restart
    still knows the bucket's newest: the note named it first. A commit
    that failed is taken back."""
    commit(tiered, 3)
    storage = tiered.backup.storage
    manifest = storage._commit_manifest
    seen = []

    def failing(path, checkpoint):
        seen.append(note(tiered))
        raise OSError(28, "No space left on the server")

    monkeypatch.setattr(storage, "_commit_manifest", failing)
    with pytest.raises(OSError, match="No space left"):
        commit(tiered, 6)
    assert seen == [{"committed": {"sequence": 1, "position": [0, 3, 3]},
                     "committing": {"sequence": 2, "position": [0, 6, 6]}}]  # fmt: skip
    assert note(tiered) == {"committed": {"sequence": 1, "position": [0, 3, 3]}}

    def noted(path, checkpoint):
        seen.append(note(tiered)["committing"]["sequence"])
        manifest(path, checkpoint)

    monkeypatch.setattr(storage, "_commit_manifest", noted)
    assert commit(tiered, 9).sequence == seen[-1] == 2
    assert note(tiered) == {"committed": {"sequence": 2, "position": [0, 9, 9]}}
