"""Host-copy weights files are the ones Keras itself writes and loads."""

from __future__ import annotations

import os
import threading

import h5py
import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import iterations, make_model, weights_of
from keras.src.saving import saving_lib

from keras_ft.state import weights_copy, weights_layout, weights_load


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


def test_capture_is_a_copy_not_a_view(data):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    layout = weights_layout.WeightsLayout(model)
    captured = layout.capture()
    before = file_bytes(captured)
    model.fit(*data, epochs=1, verbose=0)  # Changes every variable.
    assert file_bytes(captured) == before
    assert file_bytes(layout.capture()) != before


def test_a_later_layout_of_the_same_file_reuses_the_copy_buffer(data):
    """The next fit()'s state takes the last one's copy buffer (allocated
    and page-locked once) where the file is the same, and only then."""
    model = trained_model(data)
    first = weights_layout.WeightsLayout(model)
    before = file_bytes(first.capture())
    buffer = first.copy_buffer
    model.fit(*data, epochs=1, verbose=0)
    again = weights_layout.WeightsLayout(model)
    again.reuse(buffer)
    assert again.copy_buffer is buffer
    after = file_bytes(again.capture())
    assert after != before
    assert after == file_bytes(weights_layout.capture(model, copy=False))
    other = weights_layout.WeightsLayout(make_model())  # Another file.
    other.reuse(buffer)
    assert other.copy_buffer is None
    assert file_bytes(other.capture()) == file_bytes(
        weights_layout.capture(other.model, copy=False)
    )


def test_a_copy_does_not_wait_for_page_locking(data, monkeypatch):
    """Locking a buffer takes a while: a copy made before it is done goes
    into the buffer unlocked, and the lock lands later."""
    model = trained_model(data)
    layout = weights_layout.WeightsLayout(model)
    write(os.devnull, layout.capture())  # Allocated.
    release = threading.Event()
    locked = []

    def slow_lock(buffer, device):  # The driver's register call, slow.
        assert release.wait(30)
        locked.append(device)
        return lambda: locked.append("unlocked")

    monkeypatch.setattr(weights_copy, "pin_host", slow_lock)
    buffer = layout.copy_buffer
    buffer.pin("accelerator", wait=False)
    assert not buffer.pinned
    want = file_bytes(weights_layout.capture(model, copy=False))
    assert file_bytes(layout.capture()) == want  # Not held up by the lock.
    release.set()
    buffer.pin("accelerator")  # Waits for the lock started.
    assert buffer.pinned and locked == ["accelerator"]
    buffer.release()
    assert locked == ["accelerator", "unlocked"]


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


def test_load_reads_keras_own_file_in_place(tmp_path, data, monkeypatch):
    model = trained_model(data)
    path = str(tmp_path / "keras.weights.h5")
    model.save_weights(path)
    fresh = keras.models.clone_model(model)
    fresh.compile(keras.optimizers.Adam(), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    monkeypatch.setattr(fresh, "load_weights", None)  # Not the slow path.
    weights_load.load(fresh, path)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_falls_back_to_keras_for_compressed_datasets(tmp_path, data):
    model = trained_model(data)
    path = str(tmp_path / "compressed.weights.h5")
    write(path, weights_layout.capture(model))
    with h5py.File(path, "a") as f:
        kernel = f["layers/dense/vars/0"][()]
        del f["layers/dense/vars/0"]
        f["layers/dense/vars"].create_dataset("0", data=kernel, compression="gzip")
    fresh = keras.models.clone_model(model)
    fresh.compile(keras.optimizers.Adam(), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    weights_load.load(fresh, path)
    np.testing.assert_array_equal(weights_of(fresh)[0], weights_of(model)[0])


def test_load_reports_a_mismatch_as_keras_does(tmp_path, data):
    model = make_model(units=8)
    model.fit(*data, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    write(path, weights_layout.capture(model))
    other = make_model(units=16)
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="shape"):
        weights_load.load(other, path)


def saved_and_clone(tmp_path, data, build_optimizer=True):
    """A trained model, its weights file, and a clone with the same names."""
    model = trained_model(data)
    path = str(tmp_path / "w.weights.h5")
    write(path, weights_layout.capture(model))
    fresh = keras.models.clone_model(model)  # Same structure and names.
    fresh.compile(keras.optimizers.Adam(name=model.optimizer.name), loss="mse")
    if build_optimizer:
        fresh.optimizer.build(fresh.trainable_variables)
    return model, path, fresh


def test_a_file_written_for_the_same_layout_loads_without_parsing(
    tmp_path, data, monkeypatch
):
    model, path, fresh = saved_and_clone(tmp_path, data)
    layout = weights_layout.WeightsLayout(fresh)

    def no_parsing(*args):
        raise AssertionError("the file was parsed")

    monkeypatch.setattr(weights_load, "_contiguous_datasets", no_parsing)
    weights_load.load(fresh, path, layout)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == iterations(model)


def test_values_read_ahead_load_only_when_asked(tmp_path, data):
    model, path, fresh = saved_and_clone(tmp_path, data)
    before = [np.array(w) for w in weights_of(fresh)]
    layout = weights_layout.WeightsLayout(fresh)
    asked = []
    values = weights_load.read(fresh, path, layout, asked.append)
    assert values is not None
    # Read in file order, up to the end of the last value; nothing loaded.
    assert asked == sorted(asked) and asked[-1] <= os.path.getsize(path)
    for a, b in zip(before, weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    weights_load.load(fresh, path, layout, values)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == iterations(model)


@pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="staged restores are PyTorch's: JAX and TensorFlow have no public "
    "call to move a value from host memory they did not allocate without a "
    "staging copy of their own",
)
def test_a_staged_restore_moves_each_value_from_the_copy_buffer(tmp_path, data):
    """The path a model on a GPU takes (there the buffer is page-locked):
    the file is read into the layout's copy buffer, each value moved to the
    device from it, and the buffer is the next save's again, whole."""
    import torch

    model, path, fresh = saved_and_clone(tmp_path, data)
    layout = weights_layout.WeightsLayout(fresh)
    asked = []
    values = weights_load._read_staged(
        fresh, path, layout, torch.device("cpu"), asked.append
    )
    assert values is not None and values.mapped is None
    assert asked == [os.path.getsize(path)]  # The whole file, then read.
    weights_load.load(fresh, path, layout, values)
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == iterations(model)
    # A file of this size with other bytes between the values (here, its
    # signature) is not this layout's; nor is a file of another size.
    with open(path, "rb") as f:
        contents = bytearray(f.read())
    contents[0] ^= 0xFF
    other = str(tmp_path / "other.weights.h5")
    for changed in (bytes(contents), bytes(contents[1:])):
        with open(other, "wb") as f:
            f.write(changed)
        cpu = torch.device("cpu")
        assert weights_load._read_staged(fresh, other, layout, cpu, None) is None
    # The buffer the files were read into makes the next save's file, whole:
    # the bytes between the values are the layout's own again.
    fresh.fit(*data, epochs=1, verbose=0)
    again = str(tmp_path / "again.weights.h5")
    write(again, layout.capture())
    reference = str(tmp_path / "reference.weights.h5")
    write(reference, weights_layout.capture(fresh))
    with open(again, "rb") as a, open(reference, "rb") as b:
        assert a.read() == b.read()


def test_values_read_for_other_variables_are_not_used(tmp_path, data):
    model, path, fresh = saved_and_clone(tmp_path, data, build_optimizer=False)
    # Read before the optimizer has variables: the file does not fit yet.
    assert weights_load.read(fresh, path, weights_layout.WeightsLayout(fresh)) is None
    fresh.optimizer.build(fresh.trainable_variables)
    layout = weights_layout.WeightsLayout(fresh)
    values = weights_load.read(fresh, path, layout)
    other = str(tmp_path / "other.weights.h5")
    write(other, weights_layout.capture(fresh))
    own = [np.array(w) for w in weights_of(fresh)]
    weights_load.load(fresh, other, layout, values)  # Values of another file.
    for a, b in zip(own, weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert iterations(fresh) == 0 < iterations(model)


def test_a_file_of_another_layout_is_parsed_and_loads(tmp_path, data, monkeypatch):
    model = make_model()
    model.fit(*data, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    write(path, weights_layout.capture(model))
    fresh = make_model()  # New layer names: the bytes around the values differ.
    fresh.optimizer.build(fresh.trainable_variables)
    parsed = []
    original = weights_load._contiguous_datasets
    monkeypatch.setattr(
        weights_load,
        "_contiguous_datasets",
        lambda *a: parsed.append(1) or original(*a),
    )
    weights_load.load(fresh, path, weights_layout.WeightsLayout(fresh))
    assert parsed
    for a, b in zip(weights_of(model), weights_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


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


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_non_finite_values_are_found_by_the_copy(dtype):
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    finite = np.full(1000, float(ml_dtypes.finfo(dtype).max) / 10, dtype)
    # The sum overflows (float16 sums in float32); the values are finite.
    assert weights_copy.all_finite(finite)
    for bad in (np.nan, np.inf, -np.inf):
        values = finite.copy()
        values[997] = bad
        assert not weights_copy.all_finite(values)
    assert weights_copy.all_finite(np.arange(10, dtype="int64"))


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
