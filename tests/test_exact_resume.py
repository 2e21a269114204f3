"""Exact resume: a SIGKILLed and resumed run ends bit for bit where an
uninterrupted one does (Dropout, shuffling, stateful callbacks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import SPREAD, TESTS_DIR, run_once_on, subprocess_env

SCRIPT = os.path.join(TESTS_DIR, "exact_script.py")
STEPS = 6  # 96 samples, batches of 16.


def run(out, *args):
    result = subprocess.run(
        [sys.executable, SCRIPT, out, *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    return result


def load(out):
    with open(out + ".json") as f:
        summary = json.load(f)
    with np.load(out + ".npz", allow_pickle=False) as arrays:
        return summary, {k: arrays[k] for k in arrays.files}


def killed_and_resumed(tmp_path, kill_args, *args):
    out, backup = str(tmp_path / "resumed"), str(tmp_path / "backup")
    killed = run(out, "--backup-dir", backup, *kill_args, *args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not os.path.exists(out + ".json")
    resumed = run(out, "--backup-dir", backup, *args)
    assert resumed.returncode == 0, resumed.stderr
    return (*load(out), resumed)


def assert_bitwise_equal(reference, resumed):
    assert sorted(reference) == sorted(resumed)
    for name in reference:
        np.testing.assert_array_equal(reference[name], resumed[name], err_msg=name)


@pytest.fixture(scope="module")
def stateful_reference(tmp_path_factory):
    """Uninterrupted, without keras-ft at all."""
    out = str(tmp_path_factory.mktemp("reference") / "run")
    result = run(out, "--stateful-callbacks", "--epochs", "8")
    assert result.returncode == 0, result.stderr
    return load(out)


def check_against_reference(reference, resumed_summary, resumed_arrays):
    summary, arrays = reference
    # EarlyStopping (patience 3, nothing improves) stops after epoch 4 of 8.
    assert summary["epochs"] == [0, 1, 2, 3] == resumed_summary["epochs"]
    assert resumed_summary["iterations"] == summary["iterations"] == 4 * STEPS
    # ReduceLROnPlateau halved the rate after epochs 1, 2 and 3.
    assert resumed_summary["learning_rate"] == summary["learning_rate"]
    assert summary["learning_rate"] == pytest.approx(0.01 * 0.5**3)
    # History covers every epoch, with the same values.
    assert resumed_summary["history"] == summary["history"]
    # Final weights, optimizer variables and ModelCheckpoint's best model.
    assert any(name.startswith("best") for name in arrays)
    assert_bitwise_equal(arrays, resumed_arrays)


def test_sigkill_at_an_epoch_boundary_resumes_bitwise_exact(
    tmp_path, stateful_reference
):
    summary, arrays, resumed = killed_and_resumed(
        tmp_path,
        ["--kill-at-epoch-begin", "2"],
        "--stateful-callbacks", "--epochs", "8",
    )  # fmt: skip
    assert "resuming at epoch 3/8, optimizer step 12" in resumed.stdout
    assert summary["first_epoch"] == 2
    check_against_reference(stateful_reference, summary, arrays)


@pytest.mark.compat_core
def test_sigkill_mid_epoch_resumes_bitwise_exact(tmp_path, stateful_reference):
    # Saves after batches 2, 4, 6 of each epoch; killed after batch 5 of
    # epoch 3, so batch 5 is trained again from the save after batch 4.
    summary, arrays, resumed = killed_and_resumed(
        tmp_path,
        ["--kill-after-batch", "2:5"],
        "--stateful-callbacks", "--epochs", "8", "--save-freq", "2",
    )  # fmt: skip
    assert "resuming at epoch 3/8, batch 5, optimizer step 16" in resumed.stdout
    check_against_reference(stateful_reference, summary, arrays)


def test_saves_snapshotted_on_the_device_resume_bitwise_exact(
    tmp_path, stateful_reference
):
    """snapshot="device": each save copied on the device (a second copy on
    the CPU) and moved to host memory in the background."""
    summary, arrays, resumed = killed_and_resumed(
        tmp_path,
        ["--kill-after-batch", "2:5"],
        "--stateful-callbacks", "--epochs", "8", "--save-freq", "2",
        "--snapshot", "device",
    )  # fmt: skip
    assert "resuming at epoch 3/8, batch 5, optimizer step 16" in resumed.stdout
    check_against_reference(stateful_reference, summary, arrays)


INPUTS = [
    # Arrays take the adapter the shuffled runs above take on every backend.
    pytest.param(
        "numpy-unshuffled",
        marks=run_once_on("torch", "the array adapter is tested on every backend"),
    ),
    "pydataset",
    # Per-sample weights, and validation rows split off the arrays' end.
    pytest.param("numpy-weighted", marks=run_once_on("jax", SPREAD)),
]
if keras.backend.backend() == "tensorflow":
    INPUTS.append("tf.data")
else:
    # Shuffled by PyTorch's generator: on PyTorch the one Dropout draws from,
    # on JAX one of its own (TensorFlow reads it as JAX does, into NumPy).
    INPUTS.append("dataloader")


@pytest.mark.parametrize("data", INPUTS)
def test_mid_epoch_resume_is_exact_for_other_inputs(tmp_path, data):
    reference_out = str(tmp_path / "reference")
    assert run(reference_out, "--input", data).returncode == 0
    reference_summary, reference = load(reference_out)
    summary, arrays, resumed = killed_and_resumed(
        tmp_path,
        ["--kill-after-batch", "1:3"],
        "--input", data, "--save-freq", "3",
    )  # fmt: skip
    assert "resuming at epoch 2/6, batch 4" in resumed.stdout
    assert summary["iterations"] == reference_summary["iterations"] == 6 * STEPS
    # Dataset.shuffle() reshuffles at every epoch from a seed inside the
    # pipeline: its iterator's state is in the backup, and both the rest of
    # the epoch and the later epochs come in the same order as before.
    assert "reshuffles" not in resumed.stderr
    assert summary["history"] == reference_summary["history"]
    assert_bitwise_equal(reference, arrays)


@pytest.mark.parametrize(
    "data",
    # A PyDataset's resume on every backend: test_mid_epoch_resume_is_exact_for_
    # other_inputs; here with batch ends off the thread, on one.
    ["numpy", pytest.param("pydataset", marks=run_once_on("torch", SPREAD))],
)
def test_mid_epoch_resume_is_exact_with_batch_ends_off_the_training_thread(
    tmp_path, data
):
    """Where every callback is async-safe, Keras calls the batch ends on a
    thread of its own and stops waiting for each step (JAX, PyTorch): keras-ft
    then handles each batch's end, and its saves, at the next batch's begin.
    A `PyDataset` draws NumPy noise as it loads, ahead of training."""
    reference_out = str(tmp_path / "reference")
    assert run(reference_out, "--kill-at-batch-begin", "--input", data).returncode == 0
    reference_summary, reference = load(reference_out)
    summary, arrays, resumed = killed_and_resumed(
        tmp_path,
        ["--kill-after-batch", "2:5"],
        "--kill-at-batch-begin", "--save-freq", "2", "--input", data,
    )  # fmt: skip
    # Backed up after batch 4 at batch 5's begin; killed at batch 6's begin.
    assert "resuming at epoch 3/6, batch 5, optimizer step 16" in resumed.stdout
    # TensorFlow's Keras never calls a batch end off the training thread.
    off_thread = keras.backend.backend() != "tensorflow"
    assert summary["batch_ends_off_thread"] == [off_thread]
    assert summary["iterations"] == reference_summary["iterations"] == 6 * STEPS
    assert summary["history"] == reference_summary["history"]
    assert_bitwise_equal(reference, arrays)


@pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="Keras' PyTorch trainer runs one step per execution",
)
def test_mid_epoch_resume_is_exact_with_several_steps_per_execution(tmp_path):
    """With `steps_per_execution=2`, Keras calls a batch begin and end per
    two steps (off the training thread on JAX): saves and the resume point
    fall on whole executions, and the resumed run is the uninterrupted one."""
    common = ("--steps-per-execution", "2", "--kill-at-batch-begin")
    reference_out = str(tmp_path / "reference")
    assert run(reference_out, *common).returncode == 0
    reference_summary, reference = load(reference_out)
    summary, arrays, resumed = killed_and_resumed(
        tmp_path, ["--kill-after-batch", "2:4"], *common, "--save-freq", "2"
    )
    # Backed up after 4 batches at the next execution's begin, then killed.
    assert "resuming at epoch 3/6, batch 5, optimizer step 16" in resumed.stdout
    off_thread = keras.backend.backend() == "jax"
    assert summary["batch_ends_off_thread"] == [off_thread]
    assert summary["iterations"] == reference_summary["iterations"] == 6 * STEPS
    assert summary["history"] == reference_summary["history"]
    assert_bitwise_equal(reference, arrays)
