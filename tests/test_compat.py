"""The compatibility layer: what this Keras offers, and life without it."""

from __future__ import annotations

import dataclasses
import warnings

import keras
import numpy as np
import pytest
from conftest import (
    STEPS_PER_EPOCH,
    iterations,
    make_model,
    run_two_processes,
    weights_of,
)

import keras_ft
from keras_ft import compat
from keras_ft.compat import registry

EPOCHS = 4


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """Each test starts with no capability failed or warned about."""
    fresh = {
        name: dataclasses.replace(status, failed=None, warned=False)
        for name, status in registry._known.items()
    }
    monkeypatch.setattr(registry, "_known", fresh)


class InterruptAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("Interrupting!")


class FirstEpoch(keras.callbacks.Callback):
    """The epoch of the first batch that trains (a skipped one does not)."""

    def on_train_begin(self, logs=None):
        self.epoch, self.step = None, iterations(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch is None and iterations(self.model) > self.step:
            self.epoch = self.current


def interrupted_and_resumed(backup_dir, data):
    """Weights after a fit() interrupted at the end of epoch 2 and resumed."""
    keras.utils.set_random_seed(0)
    model = make_model()
    callbacks = [
        keras_ft.BackupAndRestore(backup_dir),
        keras.callbacks.EarlyStopping(monitor="loss", patience=100),
    ]
    with pytest.raises(RuntimeError, match="Interrupting"):
        model.fit(*data, epochs=EPOCHS, batch_size=16, shuffle=False, verbose=0,
                  callbacks=[*callbacks, InterruptAtEpochEnd()])  # fmt: skip
    keras_ft.wait_for_backups()
    model, first = make_model(), FirstEpoch()
    model.fit(*data, epochs=EPOCHS, batch_size=16, shuffle=False, verbose=0,
              callbacks=[keras_ft.BackupAndRestore(backup_dir), first])  # fmt: skip
    assert first.epoch == 2
    assert iterations(model) == EPOCHS * STEPS_PER_EPOCH
    return weights_of(model)


def test_this_keras_offers_every_capability():
    found = compat.probe(warn=False)
    assert found and all(found.values()), found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_module):
    backup_dir = str(tmp_path_factory.mktemp("reference") / "backup")
    return interrupted_and_resumed(backup_dir, data_module)


@pytest.fixture(scope="module")
def data_module():
    from conftest import make_data

    return make_data()


@pytest.mark.parametrize("name", compat.names())
def test_without_a_capability_backups_still_work_and_it_is_named(
    name, tmp_path, data_module, reference
):
    if name not in compat.probe(warn=False):
        # Turning it off here changes nothing: no test to make of it.
        pytest.skip(f"capability {name!r} does not apply on this backend and Keras")
    with compat.disabled(name), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        resumed = interrupted_and_resumed(str(tmp_path / "backup"), data_module)
        # A restore into a model fit() has not built: from its build_config.
        saved = make_model()
        saved.fit(*data_module, epochs=1, batch_size=16, verbose=0)
        state = keras_ft.WorkerTrainingState(saved, str(tmp_path / "one"))
        state.back_up(0)
        state.wait()
        unbuilt = make_model(built=False)
        keras_ft.WorkerTrainingState(unbuilt, str(tmp_path / "one")).restore()
    named = [
        str(w.message)
        for w in warned
        if issubclass(w.category, keras_ft.CompatibilityWarning)
        and f"capability {name!r}" in str(w.message)
    ]
    assert len(named) == 1, [str(w.message) for w in warned]
    assert "turned off" in named[0] and "still work" in named[0]
    # The same training, to the bit: only speed or side features are lost.
    for a, b in zip(reference, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights_of(saved), weights_of(unbuilt), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_internal_that_raises_falls_back_for_the_rest_of_the_run(
    monkeypatch, tmp_path, data_module, reference
):
    def moved(model):
        raise AttributeError("module 'saving_lib' has no attribute '_save_state'")

    monkeypatch.setattr(compat, "record_saveables", moved)
    with pytest.warns(keras_ft.CompatibilityWarning, match="using it raised"):
        resumed = interrupted_and_resumed(str(tmp_path / "backup"), data_module)
    assert not compat.available("fast_weights")
    for a, b in zip(reference, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv(compat.DISABLE_ENV, "tensorboard_steps, print_msg")
    assert not compat.available("tensorboard_steps")
    assert not compat.available("print_msg")
    assert compat.available("fast_weights")
    monkeypatch.setenv(compat.DISABLE_ENV, "all")
    assert not any(compat.available(n) for n in compat.names())


def test_unknown_capability_is_a_clear_error():
    with (
        pytest.raises(ValueError, match="Unknown keras-ft capabilities"),
        compat.disabled("no_such_thing"),
    ):
        pass


@pytest.mark.compat_core
@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the TensorFlow trainer"
)
def test_the_tensorflow_trainer_is_found_by_what_it_is_not_its_name():
    # Keras 3.16 renamed TensorFlowTrainer to Trainer.
    from keras_ft.compat import multi_worker

    trainer, module = multi_worker._tensorflow_trainer()
    assert issubclass(keras.Model, trainer)
    assert callable(module.reduce_per_replica)
    assert compat.available("multi_worker_fixes")


def test_a_missing_capability_warns_once_per_process(tmp_path, data_module):
    with (
        compat.disabled("tensorboard_steps"),
        warnings.catch_warnings(record=True) as warned,
    ):
        warnings.simplefilter("always")
        for run in range(2):
            make_model().fit(
                *data_module, epochs=1, verbose=0,
                callbacks=[keras_ft.BackupAndRestore(str(tmp_path / str(run)))],
            )  # fmt: skip
    named = [w for w in warned if "'tensorboard_steps'" in str(w.message)]
    assert len(named) == 1


_AGREE = """
found = []
start = time.perf_counter()
for i in range(20):
    found.append([
        cross_process.least_in_all_processes(10 * i + index),
        cross_process.first_process_value(100 + index),
        cross_process.all_processes_agree(index == 0 or i % 2 == 0),
        cross_process.same_in_all_processes(i if i % 3 else i + index),
    ])
took = time.perf_counter() - start
"""
_AGREEMENTS = (
    """
import json, os, sys, time
import keras_ft
from keras_ft.backend import cross_process
from keras_ft import compat
index = int(sys.argv[1])
keras_ft.initialize_cluster(coordinator_address="127.0.0.1:" + sys.argv[2],
                            num_processes=2, process_id=index)
"""
    + _AGREE
    + """
from jax._src import distributed
client = distributed.global_state.client
left = []
for call in range(80):
    try:
        client.key_value_try_get(f"keras_ft/gather/{call}/{index}")
        left.append(call)
    except Exception:
        pass
print("RESULT", json.dumps({"found": found, "took": took, "left": left,
      "store": compat.available("cluster_key_value")}), flush=True)
"""
)


# What `_AGREE` finds in both processes, when they agree.
_AGREED = [[10 * i, 100, i % 2 == 0, i % 3 != 0] for i in range(20)]


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX clusters agree through JAX"
)
@pytest.mark.parametrize("store", [True, False])
def test_cluster_agreements_are_the_same_through_the_store_or_xla(tmp_path, store):
    """Two JAX processes agree on small integers through the coordination
    service's store, or through XLA all-gathers with the capability off:
    the same answers either way, and the store keeps only the last two
    calls' keys."""
    import os

    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")  # fmt: skip
    if not store:
        env[registry.DISABLE_ENV] = "cluster_key_value"
    for result in run_two_processes(_AGREEMENTS, env):
        assert result["store"] is store
        assert result["found"] == _AGREED
        assert result["left"] == ([78, 79] if store else [])


_TORCH_AGREEMENTS = (
    """
import json, sys, time
import torch.distributed as dist
from keras_ft.backend import cross_process
index = int(sys.argv[1])
alone = cross_process.gathers_across_processes()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2],
                        rank=index, world_size=2)
"""
    + _AGREE
    + """
print("RESULT", json.dumps({"found": found, "alone": alone,
      "group": cross_process.gathers_across_processes()}), flush=True)
# Leave the group together: a process that exits while its peer's gloo
# threads still talk to it aborts ("terminate called without an active
# exception").
dist.barrier()
dist.destroy_process_group()
"""
)


@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch.distributed's collectives"
)
def test_a_torch_distributed_group_agrees_through_its_collectives():
    """Two processes of a gloo group on 127.0.0.1 (as torchrun starts them)
    agree on small integers through `torch.distributed`: each would
    otherwise answer with its own value alone."""
    import os

    env = dict(os.environ, KERAS_BACKEND="torch")
    for result in run_two_processes(_TORCH_AGREEMENTS, env):
        assert result["alone"] is False and result["group"] is True
        assert result["found"] == _AGREED


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's TF_CONFIG"
)
@pytest.mark.parametrize(
    "tf_config, several",
    [
        ('{"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", '
         '"index": 1}}', True),
        ('{"cluster": {"chief": ["h:0"], "worker": ["h:1"]}, "task": {"type": '
         '"chief", "index": 0}}', True),
        ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}',
         False),
        ("not json", False),
        ("", False),
    ],
)  # fmt: skip
def test_the_multi_worker_fixes_apply_where_tf_config_lists_several(
    monkeypatch, tf_config, several
):
    """Read by compat itself, as `current_task()` reads it (compat does not
    import `distribute`, which is above it)."""
    from keras_ft.compat import multi_worker
    from keras_ft.distribute.cluster import current_task

    monkeypatch.setenv("TF_CONFIG", tf_config)
    assert multi_worker._multi_worker_here() is several
    if tf_config.startswith("{"):
        assert (current_task().num_workers > 1) is several
