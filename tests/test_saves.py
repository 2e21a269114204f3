"""keras_ft/saves/: the writer queue's hold on the pools, the tiers' error."""

from __future__ import annotations

import gc

from conftest import make_data, make_model

import keras_ft
from keras_ft import threads
from keras_ft.checkpoint.store import open_store
from keras_ft.errors import CheckpointWriteError, ProcessesDisagreeError
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


def test_a_training_collected_unreleased_lets_go_of_the_pools(tmp_path):
    """A training locked and never unlocked (its fit() raised and nothing
    followed on its directory) gives back its hold on the thread pools when
    it is garbage-collected: its finalizer only notes it (it may run in any
    thread, at any allocation), and the count of holders leaves it out."""
    holders = threads.holders()
    state = keras_ft.WorkerTrainingState(make_model(), str(tmp_path))
    state.lock()
    assert threads.holders() == holders + 1
    del state
    gc.collect()
    assert threads.holders() == holders
