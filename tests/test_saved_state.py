"""What a checkpoint's saved state must look like, checked without Keras
(`keras_ft/state/saved_state.py`). The state of real callbacks saved and
restored: `test_callback_state.py`, `test_neighbours.py`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import run_once_on

from keras_ft.state import rng, saved_state

ONCE = run_once_on("torch", "checks of saved values; the backend does not matter")


def state() -> dict:
    generators = rng.from_raw(rng.capture_raw())
    return {
        "rng": generators,
        "input": {"stream": 12, "tf_iterator": np.frombuffer(b"it", np.uint8),
                  "rng": generators, "stream_made": True},  # fmt: skip
        "logs": {"loss": 0.25, "accuracy": 1, "val_loss": None},
        "fit": 2,
        "histories": [{"epoch": [0], "history": {"loss": [0.5]}}],
        "epoch_batches": 12,
        "callbacks_pending": ["EarlyStopping:0"],
        "callbacks": {
            "EarlyStopping:0": {"wait": 1, "best": 0.3, "best_epoch": 2,
                                "best_weights": [np.ones((4, 8)), np.float32(1)]},
            "ModelCheckpoint:0": {"best": None, "_last_batch_seen": None},
            "History:0": {"epoch": [0, 1], "history": {"loss": [0.5, None],
                          "f1_score": [np.zeros(2, "float32"), None]}},
            "CSVLogger:0": {"rows": "epoch,loss\n0,0.5\n"},
            "MyCallback:0": {"anything": object()},  # Its own; checked by it.
        },
    }  # fmt: skip


@ONCE
def test_the_state_keras_ft_saves_passes():
    saved_state.check(state())
    saved_state.check({})  # Nothing saved: nothing to check.


@ONCE
@pytest.mark.parametrize(
    "change, named",
    [
        (lambda s: s.update(input=[1]), "input's position is not an object"),
        (lambda s: s["input"].update(stream=-1), "stream position is not a count"),
        (lambda s: s["input"].update(stream_made=1), "stream_made is not true"),
        (lambda s: s["input"].update(grain=b"raw"), "grain state is not bytes"),
        (lambda s: s["input"].update(tf_iterator=np.zeros(2)), "tf_iterator"),
        (lambda s: s["input"]["rng"]["numpy"].update(pos=700), "position"),
        (lambda s: s["logs"].update(loss="low"), "logs are not an object of numbers"),
        (lambda s: s["logs"].update(loss=True), "logs"),
        (lambda s: s.update(fit=0), "fit\\(\\) number"),
        (lambda s: s.update(epoch_batches="12"), "epoch's batch count"),
        (lambda s: s.update(callbacks_pending="EarlyStopping:0"), "callbacks_pending"),
        (lambda s: s.update(callbacks=[]), "callbacks' state is not an object"),
        (lambda s: s["callbacks"].update({"History:0": [1]}), "History:0 is not an"),
        (lambda s: s["callbacks"]["EarlyStopping:0"].update(wait=-2),
         "EarlyStopping:0.wait is not a count"),
        (lambda s: s["callbacks"]["EarlyStopping:0"].update(best="0.3"),
         "best is not a number or null"),
        (lambda s: s["callbacks"]["EarlyStopping:0"].update(best_weights=[[1.0]]),
         "best_weights is not null or the model's weights"),
        (lambda s: s["callbacks"]["ModelCheckpoint:0"].update(_last_batch_seen=-1),
         "_last_batch_seen is not null or a count"),
        (lambda s: s["callbacks"]["History:0"].update(history={"loss": [0.1, [1]]}),
         "history is not an object of lists of logged values"),
        (lambda s: s["callbacks"]["History:0"]["history"]["f1_score"].append(
            np.array(["x"])), "History:0.history is not"),
        (lambda s: s.update(histories={"loss": [1.0]}), "histories are not a list"),
        (lambda s: s.update(histories=[{"epoch": [0], "history": {"loss": [[1]]}}]),
         "fit\\(\\) #1's History.history is not"),
        (lambda s: s["callbacks"]["CSVLogger:0"].update(rows=b"bytes"),
         "rows is not text"),
    ],
)  # fmt: skip
def test_a_malformed_part_is_named(change, named):
    saved = copy.deepcopy(state())
    change(saved)
    with pytest.raises(ValueError, match=named):
        saved_state.check(saved)


@ONCE
def test_best_weights_are_checked_against_the_models_shapes_where_known():
    saved = {"best_weights": [np.ones((4, 8)), np.ones(8)]}
    saved_state.check_callback("EarlyStopping", "EarlyStopping:0", saved,
                               [(4, 8), (8,)])  # fmt: skip
    with pytest.raises(ValueError, match="best_weights"):
        saved_state.check_callback("EarlyStopping", "EarlyStopping:0", saved,
                                   [(4, 8), (9,)])  # fmt: skip
