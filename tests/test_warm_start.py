"""Warm start: pretrained weights on a first run, never on a resumed one."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
from conftest import tree_digest

import keras_ft


def named_model(head_units: int = 1, hidden: int = 8) -> keras.Model:
    """Layer names fixed, so that files match by name within one process."""
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(hidden, activation="relu", name="hidden"),
            keras.layers.Dense(head_units, name="head"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    return model


def values(model: keras.Model) -> dict[str, np.ndarray]:
    """By variable path below the model's own (auto-numbered) name."""
    return {
        v.path.split("/", 1)[1]: keras.ops.convert_to_numpy(v) for v in model.weights
    }


@pytest.fixture
def pretrained(tmp_path, data):
    """A trained model saved three ways: weights, .keras, keras-ft backup."""
    x, y = data
    model = named_model()
    model.fit(
        x, y, epochs=2, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(str(tmp_path / "pre_backup"),
                                             delete_checkpoint=False)],
    )  # fmt: skip
    model.save_weights(str(tmp_path / "pre.weights.h5"))
    model.save(str(tmp_path / "pre.keras"))
    return model, tmp_path


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


class AtTrainBegin(keras.callbacks.Callback):
    """The model's variables once BackupAndRestore's on_train_begin ran."""

    def __init__(self):
        super().__init__()
        self.values = None

    def on_train_begin(self, logs=None):
        self.values = values(self.model)


@pytest.mark.parametrize("source", ["pre.weights.h5", "pre.keras", "pre_backup"])
def test_applied_on_the_first_run_and_not_on_resume(pretrained, data, source, capsys):
    x, y = data
    model_pre, tmp_path = pretrained
    path = str(tmp_path / source)
    before = tree_digest(str(tmp_path))
    backup_dir = str(tmp_path / "backup")

    first = named_model()
    seen = AtTrainBegin()
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(
            x, y, epochs=3, batch_size=16, verbose=0,
            callbacks=[keras_ft.BackupAndRestore(backup_dir, warm_start=path),
                       seen, Interrupt()],
        )  # fmt: skip
    assert f"warm-started 4 variables from {path}" in capsys.readouterr().out
    pre = values(model_pre)
    for name, value in seen.values.items():
        np.testing.assert_array_equal(value, pre[name])
    keras_ft.wait_for_backups()
    backed_up = named_model()
    keras_ft.load_checkpoint(backup_dir, backed_up)

    resumed = named_model()
    seen = AtTrainBegin()
    resumed.fit(
        x, y, epochs=3, batch_size=16, verbose=0,
        callbacks=[keras_ft.BackupAndRestore(backup_dir, warm_start=path), seen],
    )  # fmt: skip
    assert "not applied" in capsys.readouterr().out
    # The backup's weights, not the pretrained file's.
    saved = values(backed_up)
    for name, value in seen.values.items():
        np.testing.assert_array_equal(value, saved[name])
    assert not all(np.array_equal(v, pre[k]) for k, v in seen.values.items())
    # The pretrained file (and backup) were only read.
    after = tree_digest(str(tmp_path))
    assert {k: v for k, v in after.items() if k in before} == before


def test_layers_pick_what_is_loaded(pretrained):
    model_pre, tmp_path = pretrained
    pre = values(model_pre)
    for layers in (["hidden"], r"hid.*"):
        model = named_model()
        fresh = values(model)
        message = keras_ft.WarmStart(str(tmp_path / "pre.keras"), layers=layers).apply(
            model
        )
        assert "warm-started 2 variables" in message
        now = values(model)
        for name, value in now.items():
            expected = pre if name.startswith("hidden/") else fresh
            np.testing.assert_array_equal(value, expected[name])


def test_a_mismatch_names_the_variable_and_both_shapes(pretrained):
    _, tmp_path = pretrained
    model = named_model(head_units=3)
    fresh = values(model)
    warm = keras_ft.WarmStart(str(tmp_path / "pre.weights.h5"))
    with pytest.raises(ValueError) as raised:
        warm.apply(model)
    text = str(raised.value)
    assert re.search(r"head/kernel has shape \(8, 1\) in the file and \(8, 3\)", text)
    assert "skip_mismatch=True" in text
    # Nothing was loaded: the check comes before any load.
    for name, value in values(model).items():
        np.testing.assert_array_equal(value, fresh[name])

    message = keras_ft.WarmStart(
        str(tmp_path / "pre.weights.h5"), skip_mismatch=True
    ).apply(model)
    assert "warm-started 2 variables" in message
    assert "skipped" in message and "head/kernel" in message


def test_bad_arguments_are_named(pretrained, tmp_path_factory):
    _, tmp_path = pretrained
    empty = tmp_path_factory.mktemp("empty")
    text_file = empty / "notes.txt"
    text_file.write_text("not weights")
    keras_file = str(tmp_path / "pre.keras")
    backup = str(empty / "b")
    cases = [
        (lambda: keras_ft.BackupAndRestore(
            backup, warm_start=str(empty / "missing.keras")), "does not exist"),
        (lambda: keras_ft.BackupAndRestore(backup, warm_start=str(empty)),
         "not a keras-ft backup"),
        (lambda: keras_ft.WarmStart(str(text_file)), "neither a Keras weights file"),
        (lambda: keras_ft.WarmStart(keras_file, layers="(["), "regular expression"),
        (lambda: keras_ft.WarmStart(keras_file, layers=[3]), "layers=[3]"),
        (lambda: keras_ft.WarmStart(keras_file, layers=["nope"]).apply(named_model()),
         "no layer named 'nope'"),
    ]  # fmt: skip
    for make, message in cases:
        with pytest.raises(ValueError, match="Invalid value for argument") as raised:
            make()
        assert message in str(raised.value)


def test_the_public_fallback_loads_the_same(pretrained):
    """Without Keras' saving internals: model.load_weights(), the rest put back."""
    from keras_ft import compat

    model_pre, tmp_path = pretrained
    pre = values(model_pre)
    with compat.disabled("fast_weights"):
        model = named_model()
        model.optimizer.build(model.trainable_variables)
        optimizer = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
        fresh = values(model)
        with pytest.warns(keras_ft.CompatibilityWarning):
            keras_ft.WarmStart(str(tmp_path / "pre_backup"), layers=["head"]).apply(
                model
            )
    for name, value in values(model).items():
        expected = pre if name.startswith("head/") else fresh
        np.testing.assert_array_equal(value, expected[name])
    # The backup's optimizer state was not taken.
    for before, now in zip(optimizer, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(before, keras.ops.convert_to_numpy(now))
