"""`keras_ft/compat/data.py`: the input a running `fit()` reads, found from
a callback, and a `PyDataset` whose trained items a resumed epoch skips."""

from __future__ import annotations

import random

import keras
import numpy as np
import pytest
from conftest import BATCH_SIZE, STEPS_PER_EPOCH, make_model
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

from keras_ft.compat import data as compat_data


class Items(keras.utils.PyDataset):
    """`count` batches; batch i holds the value i."""

    def __init__(self, count: int = STEPS_PER_EPOCH, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        x = np.full((BATCH_SIZE, 4), index, "float32")
        return x, x[:, :1]


class SeesTheInput(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        iterator = compat_data.fit_epoch_iterator()
        self.kind = compat_data.input_kind(iterator)
        self.dataset = compat_data.fit_tf_dataset(iterator)
        self.in_processes = compat_data.loads_in_processes(iterator)


def generator():
    while True:
        yield np.zeros((BATCH_SIZE, 4), "float32"), np.zeros((BATCH_SIZE, 1))


def fit_with(x, y=None, **kwargs) -> SeesTheInput:
    seen = SeesTheInput()
    make_model().fit(x, y, epochs=1, callbacks=[seen], verbose=0, **kwargs)
    return seen


def test_the_input_of_a_running_fit_is_found_from_its_callbacks(data):
    assert fit_with(*data, batch_size=BATCH_SIZE).kind == "ArrayDataAdapter"
    assert fit_with(Items()).kind == "PyDatasetAdapter"
    seen = fit_with(generator(), steps_per_epoch=2, shuffle=False)
    assert seen.kind == "GeneratorDataAdapter" and seen.dataset is None
    assert not seen.in_processes
    # Outside fit(), nothing is found.
    assert compat_data.fit_epoch_iterator() is None
    assert compat_data.input_kind(None) is None


def test_a_tf_dataset_is_found_on_any_backend(data):
    tf = pytest.importorskip("tensorflow")
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH_SIZE)
    seen = fit_with(dataset, shuffle=False)
    assert seen.kind == "TFDatasetAdapter" and seen.dataset is not None


def test_the_variables_a_tf_dataset_uses_are_found_through_its_stages():
    tf = pytest.importorskip("tensorflow")
    flip, shift = keras.layers.RandomFlip(), keras.layers.RandomTranslation(0.2, 0.2)
    images = np.zeros((8, 2, 2, 1), "float32")
    plain = tf.data.Dataset.from_tensor_slices(images).shuffle(8).batch(4)
    assert compat_data.tf_dataset_variables(plain) == []
    augmented = (
        tf.data.Dataset.from_tensor_slices(images)
        .map(flip)
        .shuffle(8)
        .batch(4)
        .map(shift, num_parallel_calls=2)
        .prefetch(2)
    )
    found = compat_data.tf_dataset_variables(augmented)
    # Each layer's seed generator: its seed, and a counter each batch moves.
    assert [tuple(v.shape) for v in found] == [(2,), (2,)]
    before = [v.numpy().copy() for v in found]
    list(augmented)
    assert all((v.numpy() != b).any() for v, b in zip(found, before, strict=True))
    assert compat_data.tf_dataset_variables(None) == []


def test_a_py_dataset_with_processes_is_said_to_load_in_them():
    seen = fit_with(Items(workers=2, use_multiprocessing=True))
    assert seen.in_processes
    assert not fit_with(Items(workers=2)).in_processes  # Threads.


def values(batches) -> list[int]:
    return [int(np.asarray(batch[0])[0, 0]) for batch in batches]


def test_skipped_items_load_nothing_and_the_rest_keep_the_epochs_order():
    adapter = PyDatasetAdapter(Items(6), shuffle=True)
    loaded = []
    view = compat_data.PyDatasetView(adapter, loaded.append)
    random.seed(3)
    trained = view.trained_indices(2)
    # The recording drew the order from the random state and left it as it
    # was: the epoch below draws the same order.
    random.seed(3)
    order = list(range(6))
    random.shuffle(order)
    assert trained == order[:2]
    random.seed(3)
    view.skip(trained, placeholders=False)
    assert values(adapter.get_numpy_iterator()) == order[2:]
    assert loaded == order[2:]  # Each load passed the hook; none skipped.
    # Placeholders: one empty batch for each skipped item, in its place.
    random.seed(3)
    view.skip(trained, placeholders=True)
    batches = list(adapter._get_iterator())
    assert [compat_data.is_placeholder(b) for b in batches] == [True] * 2 + [False] * 4
    # Removed, the adapter reads its own dataset again.
    view.remove()
    assert adapter.py_dataset.__class__ is Items
    assert len(list(adapter._get_iterator())) == 6


def test_a_py_dataset_of_unknown_length_gets_no_view():
    class Endless(Items):
        @property
        def num_batches(self):
            return None

    adapter = PyDatasetAdapter(Endless())

    class Iterator:  # What fit() holds: the adapter and its steps.
        data_adapter = adapter
        steps_per_epoch = 3

    assert compat_data.PyDatasetView.of(Iterator(), lambda index: None) is None
    Iterator.data_adapter = PyDatasetAdapter(Items())
    assert compat_data.PyDatasetView.of(Iterator(), lambda index: None) is None
    Iterator.steps_per_epoch = STEPS_PER_EPOCH  # One pass an epoch: viewed.
    assert compat_data.PyDatasetView.of(Iterator(), lambda index: None) is not None
