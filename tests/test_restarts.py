"""Restarts that make no progress are named (`keras_ft/training/restarts.py`).
A launcher that restarts a failing job: `test_launch.py`."""

from __future__ import annotations

import json

import pytest
from conftest import run_once_on

from keras_ft.checkpoint.store import open_store
from keras_ft.training import restarts

ONCE = run_once_on("torch", "the chief's notices; the backend does not matter")


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "chief"))


def recorded(store) -> dict:
    return json.loads(store.read_notice(restarts.NOTICE))


@ONCE
def test_a_restart_that_resumes_where_the_last_did_is_named(store):
    assert restarts.check_progress(store, 0, 0) is None
    with pytest.warns(UserWarning, match="restart 1 resumes at optimizer step 0"):
        said = restarts.check_progress(store, 1, 0)
    assert "as restart 0 did" in said and "look at the previous" in said
    assert recorded(store) == {"restart": 1, "step": 0}


@ONCE
def test_a_restart_that_made_progress_says_nothing(store, recwarn):
    restarts.check_progress(store, 0, 0)
    assert restarts.check_progress(store, 1, 40) is None
    assert restarts.check_progress(store, 2, 90) is None
    assert not recwarn.list
    assert recorded(store) == {"restart": 2, "step": 90}


@ONCE
def test_the_first_run_and_an_older_record_are_not_compared(store, recwarn):
    """Restart 0 is a new job (its launcher counts from there); a record of
    the same or a later restart is another job's, not a loop."""
    restarts.check_progress(store, 3, 7)
    assert restarts.check_progress(store, 0, 7) is None  # A new job.
    store.remove_notice(restarts.NOTICE)
    store.create_notice(restarts.NOTICE, b'{"restart": 5, "step": 7}')
    assert restarts.check_progress(store, 5, 7) is None  # Not an earlier one.
    assert not recwarn.list


@ONCE
@pytest.mark.parametrize(
    "record", [b"{not json", b"[1, 2]", b'{"restart": "1", "step": 0}', b"[" * 5000]
)
def test_a_damaged_record_is_replaced_without_a_warning(store, record, recwarn):
    store.create_notice(restarts.NOTICE, record)
    assert restarts.check_progress(store, 2, 0) is None
    assert not recwarn.list
    assert recorded(store) == {"restart": 2, "step": 0}
