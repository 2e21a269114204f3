"""A model's weights as a save lays them out (`keras_ft/state/weights_layout.py`):
the files written are the ones Keras itself writes and loads, the model
walked once until its variables change, every variable its own value.
Loading them: `test_weights_load.py`; the copy: `test_weights_copy.py`."""

from __future__ import annotations

import os

import h5py
import keras
import numpy as np
import pytest
from conftest import iterations, make_model, weights_of
from keras.src.saving import saving_lib

from keras_ft.state import weights_layout


def write(path, captured):
    """Writes a captured weights file as the checkpoint writer would."""
    captured.fill()
    try:
        with open(path, "wb") as f:
            for chunk in captured.chunks:
                f.write(chunk)
    finally:
        captured.release()


def layout(path):
    found = {}

    def visit(name, obj):
        attrs = {k: str(v) for k, v in obj.attrs.items()}
        if isinstance(obj, h5py.Dataset):
            found[name] = (
                "dataset",
                obj.shape,
                str(obj.dtype),
                attrs,
                obj[()].tobytes(),
            )
        else:
            found[name] = ("group", attrs)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def trained_model(data):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1, dtype="bfloat16"),
        ]
    )
    model.compile(keras.optimizers.Adam(), loss="mse")
    model.fit(*data, epochs=1, verbose=0)
    return model


def test_written_file_has_keras_own_layout(tmp_path, data):
    model = trained_model(data)
    model.save_weights(str(tmp_path / "keras.weights.h5"))
    write(str(tmp_path / "ours.weights.h5"), weights_layout.capture(model))
    assert layout(str(tmp_path / "ours.weights.h5")) == layout(
        str(tmp_path / "keras.weights.h5")
    )


def test_written_file_loads_with_load_weights(tmp_path, data):
    model = trained_model(data)
    captured = weights_layout.capture(model)
    assert sum(memoryview(c).nbytes for c in captured.chunks) > 0
    path = str(tmp_path / "ours.weights.h5")
    write(path, captured)
    fresh = keras.models.clone_model(model)
    fresh.compile(keras.optimizers.Adam(), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def file_bytes(captured) -> bytes:
    return b"".join(bytes(memoryview(c).cast("B")) for c in captured.chunks)


def test_capture_without_copy_writes_the_same_file(tmp_path, data):
    model = trained_model(data)
    assert file_bytes(weights_layout.capture(model, copy=False)) == file_bytes(
        weights_layout.capture(model, copy=True)
    )


def test_the_model_is_walked_once_until_its_variables_change(
    tmp_path, data, monkeypatch
):
    walks = []
    original = saving_lib._save_state

    def counting(*args, **kwargs):
        if kwargs["inner_path"] == "":  # The model, not a recursion.
            walks.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(saving_lib, "_save_state", counting)
    model = make_model()  # Its optimizer has no variables before fit().
    layout = weights_layout.WeightsLayout(model)
    layout.capture()
    layout.capture()
    assert len(walks) == 1
    model.fit(*data, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    write(path, layout.capture())
    assert len(walks) == 2
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    assert iterations(fresh) == iterations(model)


def test_walks_leave_keras_own_functions_in_place(data):
    original = saving_lib.get_attr_skipset
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    weights_layout.capture(model)
    assert saving_lib.get_attr_skipset is original


def test_a_layer_that_saves_other_variables_each_time_is_refused():
    class Unstable(keras.layers.Layer):
        calls = 0

        def call(self, x):
            return x

        def save_own_variables(self, store):
            Unstable.calls += 1
            for i in range(Unstable.calls):
                store[str(i)] = np.zeros(i + 1, "float32")

    model = keras.Sequential([keras.Input((4,)), Unstable(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(), loss="mse")
    with pytest.raises(RuntimeError, match="stores different variables each time"):
        weights_layout.capture(model)


def test_capture_names_the_datasets_that_are_not_finite(data):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    assert weights_layout.capture(model).non_finite == []
    bias = model.layers[0].bias
    value = np.array(keras.ops.convert_to_numpy(bias))
    value[3] = np.nan
    bias.assign(value)
    assert weights_layout.capture(model).non_finite == ["layers/dense/vars/1"]


# Every variable's own value: layers whose `save_own_variables()` stores
# something else (LoRA merges its factors, quantized LoRA re-quantizes).


def adapted_model(recipe: str, seed: int) -> keras.Model:
    """A small model with the adaptation `recipe` names, compiled."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(32, 8)(inputs)
    x = keras.layers.EinsumDense("btd,de->bte", output_shape=(6, 8))(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    outputs = keras.layers.Dense(1)(x)
    model = keras.Model(inputs, outputs)
    mode, _, lora = recipe.partition("+")
    if mode in ("int8", "int4", "float8"):
        model.quantize(mode)
    if "lora" in (mode, lora):
        for layer in model.layers:
            if hasattr(layer, "enable_lora"):
                layer.enable_lora(2)
    model.compile(keras.optimizers.AdamW(1e-2), loss="mse")
    return model


def token_data():
    rng = np.random.default_rng(3)
    return rng.integers(0, 32, (32, 6)).astype("int32"), rng.normal(
        size=(32, 1)
    ).astype("float32")


def all_values(model):
    """Every saved variable's value, by position (paths follow layer names,
    which a second model of the same structure gets numbered)."""
    return {
        f"{i}": keras.ops.convert_to_numpy(v)
        for i, v in enumerate(weights_layout.saved_variables(model))
    }


# Quantized without LoRA, int8 and int4 store their variables as they are;
# with LoRA, their kernels and scales are re-quantized merges.
@pytest.mark.parametrize("recipe", ["lora", "int8+lora", "int4+lora", "float8"])
def test_a_restore_gives_every_variable_its_own_value(tmp_path, recipe):
    import warnings

    from keras_ft import WorkerTrainingState

    x, y = token_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Layers that do not quantize say so.
        trained = adapted_model(recipe, seed=1)
        trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
        fresh = adapted_model(recipe, seed=2)
    fresh.optimizer.build(fresh.trainable_variables)
    saved = all_values(trained)
    if "lora" in recipe:
        factors = [
            str(i)
            for i, v in enumerate(trained.weights)
            if v.path.endswith(("lora_kernel_b", "lora_embeddings_b"))
        ]
        assert factors and all(np.any(saved[k]) for k in factors)  # Trained.
    WorkerTrainingState(trained, str(tmp_path)).back_up(0)
    assert WorkerTrainingState(fresh, str(tmp_path)).restore() is not None
    restored = all_values(fresh)
    assert list(restored) == list(saved)
    for path, value in saved.items():
        assert restored[path].dtype == value.dtype, path
        np.testing.assert_array_equal(restored[path], value, err_msg=path)


def test_load_weights_of_a_backup_is_what_keras_would_load(tmp_path):
    """The file's Keras groups are Keras' own (LoRA merged); a model that
    loads it with `load_weights()` matches one loading `save_weights()`."""
    from keras_ft import WorkerTrainingState

    x, y = token_data()
    trained = adapted_model("lora", seed=1)
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
    WorkerTrainingState(trained, str(tmp_path / "b")).back_up(0)
    trained.save_weights(str(tmp_path / "keras.weights.h5"))
    [checkpoint] = os.listdir(tmp_path / "b" / "chief")
    from_backup, from_keras = adapted_model("lora", 2), adapted_model("lora", 3)
    from_backup.load_weights(
        str(tmp_path / "b/chief" / checkpoint / "model.weights.h5")
    )
    from_keras.load_weights(str(tmp_path / "keras.weights.h5"))
    for a, b in zip(weights_of(from_backup), weights_of(from_keras), strict=True):
        np.testing.assert_array_equal(a, b)
    # And it differs from the exact state: the factors are zero there.
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(weights_of(from_backup), weights_of(trained), strict=True)
    )


def test_exact_values_load_on_the_public_path(tmp_path, data, monkeypatch):
    """Without Keras' saving internals, the file is `save_weights()`'s plus
    every variable's own value, and the restore applies them."""
    from keras_ft import WorkerTrainingState, compat

    x, y = token_data()
    trained = adapted_model("lora", seed=1)
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
    monkeypatch.setenv(compat.DISABLE_ENV, "fast_weights")
    WorkerTrainingState(trained, str(tmp_path)).back_up(0)
    fresh = adapted_model("lora", seed=2)
    fresh.optimizer.build(fresh.trainable_variables)
    WorkerTrainingState(fresh, str(tmp_path)).restore()
    saved, restored = all_values(trained), all_values(fresh)
    for path, value in saved.items():
        np.testing.assert_array_equal(restored[path], value, err_msg=path)


def test_the_exact_group_is_only_where_the_walk_changes_values(tmp_path, data):
    plain = trained_model(data)
    assert weights_layout.EXACT_GROUP not in layout_of(plain, tmp_path / "plain.h5")
    x, y = token_data()
    adapted = adapted_model("lora", seed=1)
    adapted.fit(x, y, batch_size=8, epochs=1, verbose=0)
    found = layout_of(adapted, tmp_path / "lora.h5")
    prefix = weights_layout.EXACT_GROUP + "/vars/"
    stored = sorted(int(k[len(prefix) :]) for k in found if k.startswith(prefix))
    # Each LoRA layer's kernel (or embeddings) and both factors; nothing else.
    changed = [
        i
        for i, v in enumerate(adapted.weights)
        if "lora_" in v.path or v.path.endswith(("/kernel", "/embeddings"))
    ]
    assert len(changed) == 4 * 3
    assert stored == changed


def layout_of(model, path):
    write(str(path), weights_layout.capture(model))
    return layout(str(path))


def test_an_export_copy_is_keras_own_file(tmp_path):
    """`keras-ft export` copies the weights file without the exact group:
    what `save_weights()` writes, LoRA merged."""
    x, y = token_data()
    trained = adapted_model("lora", seed=1)
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
    written = tmp_path / "backup.weights.h5"
    write(str(written), weights_layout.capture(trained))
    exported = tmp_path / "exported.weights.h5"
    weights_layout.copy_for_inference(str(written), str(exported))
    keras_own = tmp_path / "keras.weights.h5"
    trained.save_weights(str(keras_own))
    assert weights_layout.EXACT_GROUP in layout(str(written))
    found, expected = layout(str(exported)), layout(str(keras_own))
    assert sorted(found) == sorted(expected)
    for name, entry in expected.items():
        assert found[name] == entry, name
