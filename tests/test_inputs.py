"""A resumed epoch skips its trained PyDataset items at the source:
`__getitem__` runs only for what is left to train (and Keras slices no
trained rows of NumPy arrays), and the run still ends where an uninterrupted
one does."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest
from conftest import (
    SPREAD,
    TESTS_DIR,
    backup_deleted,
    make_data,
    make_model,
    run_once_on,
    subprocess_env,
)

import keras_ft
from keras_ft import compat
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.training.inputs import InputPosition

ITEMS, BATCH, FEATURES = 12, 8, 4
SAVE_FREQ, CRASH_AFTER = 4, 6  # Saved after 4 batches of epoch 2, crashed after 6.


class Items(keras.utils.PyDataset):
    """Notes each item it loads (in a file: worker processes load too), and
    adds NumPy noise to it where asked, like an augmentation."""

    def __init__(self, x, y, log, noise, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.log, self.noise = x, y, str(log), noise
        self.armed = False

    def __len__(self):
        return ITEMS

    def __getitem__(self, index):
        if self.armed:
            with open(self.log, "a") as f:
                f.write(f"{index}\n")
        part = slice(index * BATCH, (index + 1) * BATCH)
        x = self.x[part]
        if self.noise:
            x = x + np.random.normal(scale=0.01, size=x.shape)
        return x.astype("float32"), self.y[part]

    def loads(self):
        with open(self.log) as f:
            return [int(line) for line in f]


class Arm(keras.callbacks.Callback):
    """Counts loads from train begin on (not the batches fit() reads to
    build the model)."""

    def __init__(self, items):
        super().__init__()
        self.items = items

    def on_train_begin(self, logs=None):
        self.items.armed = True


class Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch + 1 == CRASH_AFTER:
            raise RuntimeError("crash")


@pytest.fixture(autouse=True, scope="module")
def warm_up(tmp_path_factory):
    # The first fit() of a process may draw from NumPy's generator once
    # (Keras 3.10's PyTorch backend does) and the runs compared here are
    # each seeded: have it happen before any of them.
    fit(tmp_path_factory.mktemp("warm-up"))


_FITS = itertools.count()


def backup_callback(backup_dir) -> list:
    """keras-ft's callback as every run here has it, if a backup is asked for."""
    if backup_dir is None:
        return []
    return [
        keras_ft.BackupAndRestore(
            str(backup_dir), save_freq=SAVE_FREQ, delete_checkpoint=False
        )
    ]


def seeded_model_and_data() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """The tests' model (Dropout draws: order matters) and rows, seeded."""
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ITEMS * BATCH, FEATURES)).astype("float32")
    y = x[:, :1] * 2 - x[:, 1:2]
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    return model, x, y


def fit(tmp_path, backup_dir=None, crash=False, noise=True, kind=Items, **workers):
    model, x, y = seeded_model_and_data()
    # A log of its own: the enqueuer of a fit() that raised goes on loading
    # (and noting) the rest of its epoch in the background.
    log = tmp_path / f"loads-{next(_FITS)}"
    log.write_text("")
    items = kind(x, y, log, noise, **workers)
    callbacks = [Arm(items), *backup_callback(backup_dir)]
    if crash:
        callbacks.append(Crash())
        with pytest.raises(RuntimeError, match="crash"):
            model.fit(items, epochs=2, shuffle=True, verbose=0, callbacks=callbacks)
    else:
        model.fit(items, epochs=2, shuffle=True, verbose=0, callbacks=callbacks)
    return model, items.loads()


def resumed(tmp_path, **kwargs):
    backup = tmp_path / "backup"
    _, before = fit(tmp_path, backup, crash=True, **kwargs)
    model, loads = fit(tmp_path, backup, **kwargs)
    return model, before, loads


def assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.compat_core
def test_resumed_epoch_loads_only_untrained_items_bitwise_exact(tmp_path):
    reference, _ = fit(tmp_path)
    model, before, loads = resumed(tmp_path)
    # The crashed run's epoch 2 loaded its order from the start (and maybe
    # further ahead); the resumed run loads the rest of it, and only that.
    second_epoch = before[ITEMS:]
    assert sorted(loads) == sorted(second_epoch[SAVE_FREQ:] + [
        i for i in range(ITEMS) if i not in second_epoch
    ])  # fmt: skip
    assert len(loads) == ITEMS - SAVE_FREQ
    assert not set(loads) & set(second_epoch[:SAVE_FREQ])
    # The noise the skipped loads would have drawn is not drawn, and the rest
    # draws what it drew before: bit for bit.
    assert_same_weights(reference, model)


class ShuffledItems(Items):
    """Its own order of the items, reshuffled at each epoch's end from a
    generator of its own, as many a `PyDataset` is written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = np.arange(ITEMS)
        self.rng = np.random.default_rng(7)

    def __getitem__(self, index):
        return super().__getitem__(int(self.order[index]))

    def on_epoch_end(self):
        self.rng.shuffle(self.order)


class ShuffledItemsWithState(ShuffledItems):
    def get_state(self):
        return {"order": self.order, "rng": self.rng.bit_generator.state}

    def set_state(self, state):
        self.order = state["order"]
        self.rng.bit_generator.state = state["rng"]


def test_a_py_dataset_carries_its_own_state_through_get_state(tmp_path):
    """Saved as a callback's is: the resumed epoch reads its own order."""
    reference, _ = fit(tmp_path, kind=ShuffledItemsWithState)
    model, _, loads = resumed(tmp_path, kind=ShuffledItemsWithState)
    assert len(loads) == ITEMS - SAVE_FREQ
    assert_same_weights(reference, model)


@run_once_on("jax", "a warning at the first save")
def test_a_py_dataset_changed_at_epoch_ends_without_get_state_is_named(tmp_path):
    with pytest.warns(UserWarning, match=r"ShuffledItems, the PyDataset fit\(\) "
                      r"reads, defines on_epoch_end\(\) but no get_state"):  # fmt: skip
        fit(tmp_path, tmp_path / "backup", kind=ShuffledItems)


WORKERS = [
    pytest.param({"workers": 2}, id="threads"),
    pytest.param(
        {"workers": 2, "use_multiprocessing": True},
        id="processes",
        marks=pytest.mark.skipif(
            keras.backend.backend() == "jax",
            reason="Keras' worker processes fork JAX, which is multithreaded",
        ),
    ),
]


@pytest.mark.parametrize("workers", WORKERS)
def test_workers_skip_trained_items(tmp_path, workers):
    model, _, loads = resumed(tmp_path, noise=False, **workers)
    # Each untrained item once (workers load in parallel: their log is not
    # in the epoch's order).
    assert len(set(loads)) == len(loads) == ITEMS - SAVE_FREQ
    if keras.backend.backend() == "tensorflow":
        # On JAX and PyTorch, fit() builds the model from a batch that the
        # enqueuer then hands out again in the first epoch, in a timing-
        # dependent number: an uninterrupted run is not reproducible itself.
        reference, _ = fit(tmp_path, noise=False, **workers)
        assert_same_weights(reference, model)


def test_replay_without_the_internals_stays_exact(tmp_path):
    reference, _ = fit(tmp_path)
    with compat.disabled("input_skip"):
        model, _, loads = resumed(tmp_path)
    assert len(loads) == ITEMS  # The trained items are loaded again.
    assert_same_weights(reference, model)


@run_once_on("jax", "the backup format does not depend on the backend")
def test_backup_without_input_position_replays(tmp_path):
    # A backup written where the input could not be followed (an older
    # keras-ft, a Keras without the internals) is resumed by replay.
    reference, _ = fit(tmp_path)
    backup = tmp_path / "backup"
    with compat.disabled("input_skip"):
        fit(tmp_path, backup, crash=True)
    model, loads = fit(tmp_path, backup)
    assert len(loads) == ITEMS
    assert_same_weights(reference, model)


class Rows(np.ndarray):
    """Arrays that note the rows Keras slices out of them, once armed."""

    read: list[int] = []
    armed = False

    def __getitem__(self, index):
        if Rows.armed and isinstance(index, (np.ndarray, slice, list)):
            rows = np.arange(len(self))[index]
            Rows.read.extend(int(r) for r in rows)
        return np.asarray(super().__getitem__(index))


class ArmRows(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        Rows.read, Rows.armed = [], True

    def on_train_end(self, logs=None):
        Rows.armed = False


def arrays_fit(tmp_path, backup_dir=None, crash=False, shuffle=True):
    model, x, y = seeded_model_and_data()
    callbacks = [ArmRows(), *backup_callback(backup_dir)]
    if crash:
        callbacks.append(Crash())
    try:
        model.fit(
            x.view(Rows), y, batch_size=BATCH, epochs=2, shuffle=shuffle,
            verbose=0, callbacks=callbacks,
        )  # fmt: skip
    except RuntimeError:
        assert crash
    finally:
        Rows.armed = False
    return model, list(Rows.read)


# Keras slices arrays as each batch is pulled on JAX and PyTorch, inside
# tf.data on TensorFlow (replayed there).
SLICES_IN_PYTHON = keras.backend.backend() != "tensorflow"


@pytest.mark.compat_core
@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_resumed_epoch_slices_only_untrained_rows_of_arrays(tmp_path, shuffle):
    reference, _ = arrays_fit(tmp_path, shuffle=shuffle)
    backup = tmp_path / "backup"
    _, before = arrays_fit(tmp_path, backup, crash=True, shuffle=shuffle)
    model, rows = arrays_fit(tmp_path, backup, shuffle=shuffle)
    assert_same_weights(reference, model)  # Bit for bit.
    if SLICES_IN_PYTHON:
        # The crashed run sliced epoch 2's first batches; the resumed run
        # slices the rest of its order, each row once, and nothing trained.
        trained = before[ITEMS * BATCH :][: SAVE_FREQ * BATCH]
        assert len(rows) == len(set(rows)) == (ITEMS - SAVE_FREQ) * BATCH
        assert sorted(rows + trained) == list(range(ITEMS * BATCH))


@pytest.mark.skipif(not SLICES_IN_PYTHON, reason="sliced inside tf.data")
def test_arrays_replayed_without_the_internals_stay_exact(tmp_path):
    reference, _ = arrays_fit(tmp_path)
    backup = tmp_path / "backup"
    with compat.disabled("array_skip"):
        arrays_fit(tmp_path, backup, crash=True)
        model, rows = arrays_fit(tmp_path, backup)
    assert len(rows) == ITEMS * BATCH  # The trained rows are sliced again.
    assert_same_weights(reference, model)


def tf_data_fit(tmp_path, backup_dir=None, crash=False, reshuffle=False):
    """A tf.data pipeline with a `py_function` (state outside the graph,
    which TensorFlow cannot checkpoint), counting its calls."""
    import tensorflow as tf

    calls = []

    def load(index):
        calls.append(int(index))
        return index

    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ITEMS * BATCH, FEATURES)).astype("float32")
    y = x[:, :1] * 2 - x[:, 1:2]
    dataset = (
        tf.data.Dataset.range(ITEMS)
        .shuffle(ITEMS, seed=3, reshuffle_each_iteration=reshuffle)
        .map(lambda i: tf.ensure_shape(tf.py_function(load, [i], tf.int64), ()))
        .map(lambda i: (tf.gather(x.reshape(ITEMS, BATCH, -1), i),
                        tf.gather(y.reshape(ITEMS, BATCH, -1), i)))
    )  # fmt: skip
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    callbacks = [Crash()] if crash else []
    callbacks += backup_callback(backup_dir)
    try:
        model.fit(dataset, epochs=2, verbose=0, callbacks=callbacks)
    except RuntimeError:
        assert crash
    return model, calls


# On JAX and PyTorch Keras reads a tf.data pipeline through NumPy: no iterator
# state is saved, and the trained batches are replayed.
def test_tf_data_that_cannot_be_saved_is_replayed_exactly(tmp_path):
    reference, _ = tf_data_fit(tmp_path)
    backup = tmp_path / "backup"
    tf_data_fit(tmp_path, backup, crash=True)
    model, calls = tf_data_fit(tmp_path, backup)
    # The trained batches of the epoch went through the pipeline again (JAX
    # and PyTorch read a few items ahead of training, past the last step).
    if keras.backend.backend() == "tensorflow":
        assert len(calls) == ITEMS
    assert ITEMS <= len(calls) <= ITEMS + 4
    assert_same_weights(reference, model)


def test_tf_data_that_cannot_be_saved_and_reshuffles_is_replayed_exactly(tmp_path):
    """The epochs before the resumed one drew their orders as Keras made
    their iterators: the resumed process makes as many first."""
    reference, _ = tf_data_fit(tmp_path, reshuffle=True)
    backup = tmp_path / "backup"
    tf_data_fit(tmp_path, backup, crash=True, reshuffle=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "BackupAndRestore: the tf.data")
        model, _ = tf_data_fit(tmp_path, backup, reshuffle=True)
    assert_same_weights(reference, model)


def test_an_older_backup_of_tf_data_that_reshuffles_says_so(tmp_path, monkeypatch):
    backup = tmp_path / "backup"
    # As keras-ft wrote backups before it counted the pipeline's iterators.
    with monkeypatch.context() as patch:
        patch.setattr(InputPosition, "iterators_made", lambda self, batch: None)
        tf_data_fit(tmp_path, backup, crash=True, reshuffle=True)
    with pytest.warns(UserWarning, match="reshuffles at every iteration"):
        tf_data_fit(tmp_path, backup, reshuffle=True)


def test_a_damaged_count_of_iterators_is_warned_of_not_made(tmp_path, monkeypatch):
    """More iterators than two an epoch (TensorFlow's made ahead) is no
    count a run writes: the resume replays as for an older backup, with
    the warning, rather than spending its time making them."""
    backup = tmp_path / "backup"
    with monkeypatch.context() as patch:
        patch.setattr(InputPosition, "iterators_made", lambda self, batch: 1000)
        tf_data_fit(tmp_path, backup, crash=True, reshuffle=True)
    with pytest.warns(UserWarning, match="reshuffles at every iteration"):
        tf_data_fit(tmp_path, backup, reshuffle=True)


def augmented_fit(backup_dir=None, crash=False, save_freq=SAVE_FREQ, layers=1):
    """A tf.data pipeline that reshuffles and augments in `map()` with a Keras
    random layer, as Keras' image examples do: the layer's seed generator, a
    variable the pipeline uses, moves with every batch, from epoch to
    epoch."""
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    shifts = [keras.layers.RandomTranslation(0.4, 0.4) for _ in range(layers)]

    def augment(images):
        for shift in shifts:  # Not a Sequential: JAX's Keras has it run JAX ops.
            images = shift(images)
        return images

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ITEMS * BATCH, 2, 2, 1)).astype("float32")
    y = x.reshape(-1, 4)[:, :1] * 2
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=2)
        .batch(BATCH)
        .map(lambda images, labels: (augment(images), labels))
    )
    # Else TensorFlow maps ahead in a thread of its own as far as timing lets
    # it, also for the batch Keras 3.10's JAX trainer peeks at before the
    # first epoch: the uninterrupted runs would differ among themselves.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    dataset = dataset.with_options(options)
    model = keras.Sequential([
        keras.Input((2, 2, 1)), keras.layers.Flatten(), keras.layers.Dense(1)
    ])  # fmt: skip
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    callbacks = [Crash()] if crash else []
    if backup_dir is not None:
        callbacks.append(keras_ft.BackupAndRestore(str(backup_dir), save_freq))
    try:
        model.fit(dataset, epochs=3, verbose=0, callbacks=callbacks)
    except RuntimeError:
        assert crash
    return model


@pytest.mark.compat_core
@pytest.mark.parametrize("save_freq", [SAVE_FREQ, "epoch"])
def test_a_tf_data_pipeline_augmenting_with_a_random_layer_resumes_exact(
    tmp_path, save_freq
):
    """Replayed from the values its variables had when the epoch began:
    resumed mid-epoch, or at the begin of the epoch after the save."""
    pytest.importorskip("tensorflow")
    reference = augmented_fit()
    backup = tmp_path / "backup"
    augmented_fit(backup, crash=True, save_freq=save_freq)
    assert_same_weights(reference, augmented_fit(backup, save_freq=save_freq))


def test_a_tf_data_pipeline_with_other_variables_than_backed_up_says_so(tmp_path):
    pytest.importorskip("tensorflow")
    backup = tmp_path / "backup"
    augmented_fit(backup, crash=True)
    with pytest.warns(UserWarning, match="variables .* are not those backed up"):
        augmented_fit(backup, layers=2)


def test_a_generator_replays_and_says_how_much(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ITEMS, BATCH, FEATURES)).astype("float32")
    y = x[..., :1] * 2

    def batches():
        while True:
            yield from zip(x, y, strict=True)

    def fit_generator(crash):
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        callbacks = [
            keras_ft.BackupAndRestore(
                str(tmp_path / "backup"), save_freq=SAVE_FREQ, delete_checkpoint=False
            )
        ]
        if crash:
            callbacks.append(Crash())
        model.fit(
            batches(), steps_per_epoch=ITEMS, epochs=2, verbose=0, callbacks=callbacks
        )

    with pytest.raises(RuntimeError, match="crash"):
        fit_generator(crash=True)
    # From the stream's start: the first epoch's batches and the second's four.
    with pytest.warns(UserWarning, match=f"the {ITEMS + SAVE_FREQ} batches it yielded"):
        fit_generator(crash=False)


@run_once_on("jax", "whether TensorFlow is imported does not depend on the backend")
def test_following_the_input_imports_no_tensorflow(tmp_path):
    # On JAX and PyTorch, a training that never touches TensorFlow must not
    # import it for keras-ft's sake (hundreds of MB).
    code = f"""
import sys
import keras, numpy as np, keras_ft
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
x = np.zeros((64, 4), "float32")
model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[
    keras_ft.BackupAndRestore({str(tmp_path)!r}, save_freq=2, delete_checkpoint=False)])
keras_ft.wait_for_backups()
print("IMPORTED" if "tensorflow" in sys.modules else "CLEAN")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert out.stdout.strip().endswith("CLEAN"), out.stderr[-2000:]


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.data is TensorFlow's"
)
def test_a_forged_tf_data_state_is_refused_not_loaded(tmp_path):
    # A backup is untrusted input: bytes that are not an iterator's state of
    # this pipeline leave the iterator as it was (the epoch is replayed).
    import tensorflow as tf

    dataset = (
        tf.data.Dataset.range(100)
        .shuffle(100, seed=1, reshuffle_each_iteration=False)
        .batch(10)
    )
    other = tf.data.Dataset.range(5).map(lambda i: i * 2)
    saved = iter(other)
    next(saved)
    state = tf.io.serialize_tensor(
        tf.raw_ops.SerializeIterator(
            resource_handle=saved._iterator_resource, external_state_policy=2
        )
    ).numpy()
    rng = np.random.default_rng(0)
    forged = [
        b"",
        rng.bytes(4096),
        state[: len(state) // 2],
        state,  # Another pipeline's.
    ]
    expected = [b.numpy() for b in dataset]
    for bad in forged:
        iterator = iter(dataset)
        assert not compat.restore_tf_iterator(iterator, bad)
        got = [b.numpy() for b in iterator]
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)


def grain_fit(tmp_path, backup_dir=None, crash=False, kind="map"):
    """A Grain pipeline (a shuffled `MapDataset` of single samples, batched),
    noting each sample its source loads from train begin on."""
    grain = pytest.importorskip("grain")
    log = tmp_path / f"grain-loads-{next(_FITS)}"
    log.write_text("")

    class Source:
        def __init__(self, x, y):
            self.x, self.y, self.armed = x, y, False
            self.count = 0

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            self.count += 1
            if self.armed:
                with open(log, "a") as f:
                    f.write(f"{index}\n")
            return self.x[index], self.y[index]

    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ITEMS * BATCH, FEATURES)).astype("float32")
    y = x[:, :1] * 2 - x[:, 1:2]
    source = Source(x, y)
    dataset = grain.MapDataset.source(source).shuffle(seed=3).batch(BATCH)
    if kind == "iter":
        dataset = dataset.to_iter_dataset()
    elif kind == "mix":  # The same batches; its iterator's state differs.
        dataset = grain.IterDataset.mix([dataset.to_iter_dataset()], weights=[1.0])
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")

    class Arm(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # The iterator fit() built the model from reads ahead in Grain's
            # threads: arm once it has stopped (its buffer is full).
            seen, still = -1, 0
            deadline = time.monotonic() + 5
            while still < 5 and time.monotonic() < deadline:
                still = still + 1 if source.count == seen else 0
                seen = source.count
                time.sleep(0.02)
            source.armed = True

    callbacks = [Arm(), *backup_callback(backup_dir)]
    if crash:
        callbacks.append(Crash())
    try:
        model.fit(dataset, epochs=2, verbose=0, callbacks=callbacks)
    except RuntimeError:
        assert crash
    return model, [int(line) for line in log.read_text().split()]


@pytest.mark.parametrize("kind", ["map", "iter"])
def test_grain_resumes_from_its_iterator_state(tmp_path, kind):
    """The resumed epoch's iterator starts where the backup's was: the source
    loads only the samples left to train, and the run ends bit for bit as an
    uninterrupted one."""
    import grain

    reference, _ = grain_fit(tmp_path, kind=kind)
    backup = tmp_path / "backup"
    grain_fit(tmp_path, backup, crash=True, kind=kind)
    model, loads = grain_fit(tmp_path, backup, kind=kind)
    # Every epoch's order (the shuffle is seeded once), less the batches
    # trained before the crash; Grain's threads load out of order.
    order = list(grain.MapDataset.range(ITEMS * BATCH).shuffle(seed=3))
    assert sorted(loads) == sorted(order[SAVE_FREQ * BATCH :])
    assert_same_weights(reference, model)


def test_a_grain_state_the_pipeline_refuses_is_replayed_exactly(tmp_path):
    """Resumed with a pipeline whose iterator's state is shaped otherwise
    (the same batches): Grain refuses the saved state, and the epoch's
    trained batches are drawn again, saying so."""
    reference, _ = grain_fit(tmp_path)
    backup = tmp_path / "backup"
    grain_fit(tmp_path, backup, crash=True)
    with pytest.warns(UserWarning, match="Grain could not take the saved state"):
        model, loads = grain_fit(tmp_path, backup, kind="mix")
    assert len(loads) == ITEMS * BATCH  # The whole epoch, trained part too.
    assert_same_weights(reference, model)


def test_a_forged_grain_state_is_refused_not_loaded():
    # Bytes that are not a JSON object leave the epoch to be replayed.
    from keras_ft.training.inputs import grain_state

    def saved(text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    assert grain_state(saved(b'{"next_index": 4}')) == {"next_index": 4}
    forged = [b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"{", b"[" * 100_000]
    for bad in forged:
        assert grain_state(saved(bad)) is None, bad[:20]
    assert grain_state("not bytes") is None


# One stream across epochs: an endless generator, a repeated tf.data.

STREAM_SCRIPT = f"{TESTS_DIR}/stream_script.py"


def _stream_run(work, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, STREAM_SCRIPT, str(work / "backup"), str(work / "out"), *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert done.returncode in (0, -9), done.stderr[-3000:]
    return done


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_an_epoch_the_input_ran_out_in_counts_as_run(tmp_path):
    """Arrays of 4 batches read 3 an epoch: every other epoch runs out after
    1, and Keras counts it as run (the next one starts a pass). So does the
    backup: it holds the whole epoch, and a fit() that ran every epoch
    deletes it."""
    x, y = make_data()
    args = {"batch_size": 16, "steps_per_epoch": 3, "epochs": 2, "verbose": 0}
    kept = str(tmp_path / "kept")
    callback = keras_ft.BackupAndRestore(kept, delete_checkpoint=False, verbose=0)
    make_model().fit(x, y, callbacks=[callback], **args)
    metadata = CheckpointStore(os.path.join(kept, "chief")).latest_good()[1]
    assert metadata["epochs_completed"] == 2 and not metadata["batches_completed"]
    deleted = str(tmp_path / "deleted")
    make_model().fit(x, y, callbacks=[keras_ft.BackupAndRestore(deleted)], **args)
    assert backup_deleted(deleted)


@pytest.fixture(scope="module")
def whole_streams(tmp_path_factory):
    """The uninterrupted run of each kind of stream, made once: its weights."""
    runs = {}

    def whole(kind: str) -> list[np.ndarray]:
        if kind not in runs:
            work = tmp_path_factory.mktemp(f"whole-{kind}")
            _stream_run(work, "--input", kind)
            with np.load(work / "out.npz") as saved:
                runs[kind] = [saved[k] for k in sorted(saved)]
        return runs[kind]

    return whole


# Each backend's loop reads a stream in one of the ways; every way runs
# once (the stream's position does not depend on the backend), but arrays,
# as most scripts pass them, on every backend.
@pytest.mark.parametrize(
    "kind, save_freq, kill_at",
    [
        pytest.param("generator", "2", "2:4", marks=run_once_on("jax", SPREAD)),
        # TensorFlow draws it ahead, in a tf.data thread.
        pytest.param(
            "generator", "epoch", "2:4", marks=run_once_on("tensorflow", SPREAD)
        ),
        # At an epoch's begin: arrays' below, on every backend.
        pytest.param("repeat", "2", "2:4", marks=run_once_on("torch", SPREAD)),
        # Resumed at epoch 1, 5 batches into the pass epoch 0 began.
        ("arrays", "epoch", "1:2"),
        # Backed up at the end of epoch 1, where the arrays ran out: epoch 2
        # begins a pass (Keras made its iterator at epoch 1's end: on
        # PyTorch that draws from the generator the training draws from).
        pytest.param("arrays", "epoch", "2:4", marks=run_once_on("torch", SPREAD)),
        pytest.param("arrays", "2", "2:4", marks=run_once_on("jax", SPREAD)),
        pytest.param("pydataset", "2", "3:1", marks=run_once_on("torch", SPREAD)),
        # A PyTorch DataLoader's shuffle draws from PyTorch's generator, on
        # PyTorch the one training draws from (on JAX: test_exact_resume).
        pytest.param("dataloader", "2", "3:1", marks=run_once_on("torch", SPREAD)),
        pytest.param("pydataset", "epoch", "1:2", marks=run_once_on("jax", SPREAD)),
        # TensorFlow loads it ahead in a tf.data thread (it drew other noise).
        pytest.param("pydataset", "2", "3:2", marks=run_once_on("tensorflow", SPREAD)),
    ],
)
def test_a_stream_read_across_epochs_resumes_at_its_own_position(
    tmp_path, whole_streams, kind, save_freq, kill_at
):
    """steps_per_epoch=5 of a stream of 8-batch passes, SIGKILLed at
    `kill_at`: resumed mid-epoch (a save every 2 batches) or at the
    epoch's begin, the rest trains on the uninterrupted run's batches."""
    args = ["--input", kind, "--save-freq", save_freq]
    _stream_run(tmp_path, *args, "--kill-at", kill_at)
    resumed = _stream_run(tmp_path, *args)
    with np.load(tmp_path / "out.npz") as saved:
        weights = [saved[k] for k in sorted(saved)]
    for want, got in zip(whole_streams(kind), weights, strict=True):
        np.testing.assert_array_equal(got, want)
    if kind == "generator":  # The truth: drawn again from the stream's start.
        assert "drawn from it again" in resumed.stderr
        assert "batches it yielded before the backup" in resumed.stderr
