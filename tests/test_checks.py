"""Whether a checkpoint fits the model it is restored into, checked before
anything is loaded (`keras_ft/state/checks.py`). Whole restores of such
backups: `test_hostile_backups.py`, `test_worker_training_state.py`."""

from __future__ import annotations

import os

import keras
import pytest

from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import checks

MODEL = [
    ["model", "dense/kernel", [4, 8], "float32"],
    ["model", "dense/bias", [8], "float32"],
    ["optimizer", "adam/m", [4, 8], "float32"],
]


def unbuilt() -> keras.Model:
    return keras.Sequential([keras.layers.Dense(3)], name="mlp")


class Compiled:
    """What `check_variables` reads of a model: whether it has an optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


@pytest.mark.parametrize(
    "saved, named",
    [
        ([MODEL[0], ["model", "dense/bias", [9], "float32"], MODEL[2]],
         r"'dense/bias' has shape \(8,\), but the backup's 'dense/bias' has "
         r"shape \(9,\)"),
        ([MODEL[0], ["model", "dense/bias", [8], "bfloat16"], MODEL[2]],
         "is float32, but the backup's 'dense/bias' is bfloat16"),
        (MODEL[1:], "has shape"),  # One missing: the rest shift.
        (MODEL[:2], "the backup has 0 optimizer variables, the model has 1"),
        (MODEL + [["optimizer", "adam/v", [4, 8], "float32"]],
         "the backup has 2 optimizer variables, the model has 1 "
         r"\(first unmatched: 'adam/v' with shape \(4, 8\)\)"),
    ],
)  # fmt: skip
def test_a_backup_that_does_not_match_is_refused_naming_the_first_difference(
    saved, named
):
    with pytest.raises(ValueError, match=named) as raised:
        checks.check_variables(Compiled("adam"), MODEL, saved, "/backup/ckpt-1")
    assert "/backup/ckpt-1" in str(raised.value)
    assert "another `backup_dir`" in str(raised.value)


def test_a_matching_backup_and_a_model_without_an_optimizer_pass():
    checks.check_variables(Compiled("adam"), MODEL, [list(v) for v in MODEL], "d")
    # A model to evaluate restores the weights only: the optimizer's are
    # not compared.
    checks.check_variables(Compiled(None), MODEL[:2], MODEL, "d")


@pytest.mark.parametrize(
    "shape, dtype, expected",
    [((4, 8), "float32", 128), ((3,), "bfloat16", 6), ((), "int64", 8),
     ((2, 0), "float32", 0), ((5,), "no such dtype", 5),
     ((2**40, 2**30), "float64", 2**73)],  # No overflow: Python integers.
)  # fmt: skip
def test_bytes_of_a_value(shape, dtype, expected):
    assert checks.nbytes(shape, dtype) == expected


def test_a_build_config_that_builds_more_than_the_files_hold_is_damage(tmp_path):
    with open(tmp_path / "weights.bin", "wb") as f:
        f.write(b"\0" * 1024)
    os.mkdir(tmp_path / "more")
    with open(tmp_path / "more" / "part", "wb") as f:
        f.write(b"\0" * 1024)
    os.symlink("/dev/zero", tmp_path / "link")  # Counts for nothing.
    honest = {"input_shape": [None, 16]}  # 16 x 3 + 3 floats: 204 bytes.
    checks.check_build_config(unbuilt(), str(tmp_path), {"build_config": honest})
    forged = {"input_shape": [None, 10**9]}
    with pytest.raises(CorruptCheckpointError, match="bytes of variables, but its "
                       "files hold 2048 bytes"):  # fmt: skip
        checks.check_build_config(unbuilt(), str(tmp_path), {"build_config": forged})
    beyond_int64 = {"input_shape": [None, 2**70]}
    with pytest.raises(CorruptCheckpointError, match="files hold 2048 bytes"):
        checks.check_build_config(
            unbuilt(), str(tmp_path), {"build_config": beyond_int64}
        )


def test_a_built_model_or_a_backup_without_a_build_config_is_not_checked(tmp_path):
    built = unbuilt()
    built.build((None, 4))
    forged = {"build_config": {"input_shape": [None, 10**9]}}
    checks.check_build_config(built, str(tmp_path), forged)
    checks.check_build_config(unbuilt(), str(tmp_path), {})
