"""HDF5 from a backup is untrusted: nothing that reads other files, or
declares more data than the file holds, is read; the restore falls back."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import h5py
import numpy as np
import pytest
from conftest import make_model, weights_of

from keras_ft import WorkerTrainingState
from keras_ft.checkpoint import files as file_io
from keras_ft.errors import CorruptCheckpointError
from keras_ft.state import arrays, hdf5


def outside_file(tmp_path):
    """A file outside any backup, whose bytes must never be read into one."""
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(b"SECRET-" * 64)
    return secret


def hostile_files(tmp_path):
    """`{name: writer(path)}`: HDF5 files keras-ft did not write."""
    secret = outside_file(tmp_path)

    def external_link(path):
        with h5py.File(path, "w") as f:
            f["a0"] = h5py.ExternalLink(str(secret), "/data")

    def soft_link(path):
        with h5py.File(path, "w") as f:
            f["real"] = np.arange(4.0)
            f["a0"] = h5py.SoftLink("/real")

    def external_storage(path):
        with h5py.File(path, "w") as f:
            f.create_dataset(
                "a0", shape=(64,), dtype="u1", external=[(str(secret), 0, 64)]
            )

    def virtual(path):
        source = str(tmp_path / "outside" / "source.h5")
        with h5py.File(source, "w") as f:
            f["data"] = np.arange(8.0)
        layout = h5py.VirtualLayout(shape=(8,), dtype="f8")
        layout[:] = h5py.VirtualSource(source, "data", shape=(8,))
        with h5py.File(path, "w") as f:
            f.create_virtual_dataset("a0", layout)

    def compressed_bomb(path):
        with h5py.File(path, "w") as f:
            f.create_dataset(
                "a0", shape=(2**26,), dtype="f8", chunks=(2**20,),
                compression="gzip", fillvalue=0.0,
            )  # fmt: skip

    def declared_not_stored(path):
        with h5py.File(path, "w") as f:
            f.create_dataset("a0", shape=(2**20,), dtype="f8")  # Never written.

    return {
        "external link": external_link,
        "soft link": soft_link,
        "external raw storage": external_storage,
        "virtual dataset": virtual,
        "compressed shape bomb": compressed_bomb,
        "declared, not stored": declared_not_stored,
    }


KINDS = [
    "external link",
    "soft link",
    "external raw storage",
    "virtual dataset",
    "compressed shape bomb",
    "declared, not stored",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_keras_ft_did_not_write_is_refused(tmp_path, kind):
    path = str(tmp_path / "arrays.h5")
    writers = hostile_files(tmp_path)
    assert sorted(writers) == sorted(KINDS)
    writers[kind](path)
    with pytest.raises(CorruptCheckpointError, match="arrays.h5"):
        arrays.read(path)


def test_keras_ft_own_files_pass(tmp_path):
    path = tmp_path / "arrays.h5"
    path.write_bytes(arrays.to_bytes({"a0": np.arange(5.0), "a1": np.ones((2, 3))}))
    with h5py.File(path, "r") as f:
        hdf5.check_plain(f, str(path))
    assert sorted(arrays.read(str(path))) == ["a0", "a1"]


def resign(checkpoint_dir):
    """Rewrites a checkpoint's manifest to match its files, as a writer with
    access to the backup could: only the contents can give it away."""
    path = os.path.join(checkpoint_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        manifest["files"][name] = file_io.entry(os.path.join(checkpoint_dir, name))
    body = {k: v for k, v in manifest.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    manifest["digest"] = hashlib.sha256(text.encode()).hexdigest()
    with open(path, "w") as f:
        json.dump(manifest, f)


def two_checkpoints(tmp_path, data):
    """A backup of two epochs: its directory, the newest checkpoint, and the
    weights the older one holds."""
    x, y = data
    backup = str(tmp_path / "backup")
    model = make_model()
    state = WorkerTrainingState(model, backup, keep=2)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    state.back_up(0)
    older = weights_of(model)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    return backup, state.back_up(1), older


@pytest.mark.parametrize("kind", ["external raw storage", "compressed shape bomb"])
def test_a_restore_falls_back_past_a_hostile_arrays_file(tmp_path, data, kind):
    backup, newest, older = two_checkpoints(tmp_path, data)
    hostile_files(tmp_path)[kind](newest.file(arrays.ARRAYS_FILE))
    resign(newest.path)
    fresh = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = WorkerTrainingState(fresh, backup).restore()
    said = [str(w.message) for w in caught if "Falling back" in str(w.message)]
    assert len(said) == 1 and "arrays.h5" in said[0], said
    assert point.epoch == 1  # The older checkpoint.
    for got, want in zip(weights_of(fresh), older, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "metadata_change",
    [
        {"build_config": "not an object"},
        {"state": ["not", "an", "object"]},
        {"epochs_completed": 1.5},
    ],
)
def test_a_restore_falls_back_past_odd_metadata(tmp_path, data, metadata_change):
    backup, newest, _ = two_checkpoints(tmp_path, data)
    path = newest.file("metadata.json")
    with open(path) as f:
        metadata = json.load(f)
    metadata.update(metadata_change)
    with open(path, "w") as f:
        json.dump(metadata, f)
    resign(newest.path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = WorkerTrainingState(make_model(), backup).restore()
    assert any("Falling back" in str(w.message) for w in caught)
    assert point.epoch == 1
