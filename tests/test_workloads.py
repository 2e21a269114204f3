"""Fine-tunes as users run them resume bit for bit: a KerasHub causal LM
with LoRA, int8 + LoRA, mixed precision, gradient accumulation and EMA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import TESTS_DIR, run_once_on, subprocess_env

pytest.importorskip("keras_hub", exc_type=ImportError)  # Needs a newer Keras.

SCRIPT = os.path.join(TESTS_DIR, "workload_script.py")


def start(out, *args):
    return subprocess.Popen(
        [sys.executable, SCRIPT, out, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def finish(process):
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run(out, *args):
    return finish(start(out, *args))


def load(out):
    with open(out + ".json") as f:
        summary = json.load(f)
    with np.load(out + ".npz", allow_pickle=False) as arrays:
        return summary, {k: arrays[k] for k in arrays.files}


def test_keras_hub_fine_tunes_resume_bitwise_exact(tmp_path):
    """Each recipe's training crashes mid-epoch (the last one by SIGKILL)
    after a backup at batch 4 of the second epoch, and resumes in a new
    process: every model and optimizer variable, `iterations` and the
    optimizer variables' paths equal an uninterrupted run's, without
    keras-ft. The crashed run snapshots on the device, as "auto" does on a
    GPU (int8 kernels, loss-scale and EMA variables included); the resumed
    one copies to host memory, as "auto" does on the CPU."""
    reference = str(tmp_path / "reference")
    out, backup = str(tmp_path / "resumed"), str(tmp_path / "backup")
    # Side by side (each mostly compiles, on one core).
    uninterrupted = start(reference)
    crashed = run(
        out, "--backup-dir", backup, "--crash-after", "1:5", "--snapshot", "device"
    )
    result = finish(uninterrupted)
    assert result.returncode == 0, result.stderr
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = run(out, "--backup-dir", backup)
    assert resumed.returncode == 0, resumed.stderr
    restored = [line for line in resumed.stdout.splitlines() if "restored" in line]
    assert len(restored) == 3 and all("epoch 2/2, batch 5" in r for r in restored)
    expected, expected_arrays = load(reference)
    found, found_arrays = load(out)
    assert sorted(expected) == ["int8-lora-ema", "lora-accumulate", "mixed"]
    assert found == expected  # Iterations and optimizer variable paths.
    assert expected["mixed"]["optimizer"] == "LossScaleOptimizer"
    assert expected["lora-accumulate"]["iterations"] == 4  # 12 batches / 3.
    assert sorted(found_arrays) == sorted(expected_arrays)
    trained_factors = [
        name
        for name in expected_arrays
        if name.startswith("int8") and np.any(expected_arrays[name])
    ]
    assert trained_factors
    for name, value in expected_arrays.items():
        assert found_arrays[name].dtype == value.dtype, name
        np.testing.assert_array_equal(found_arrays[name], value, err_msg=name)


EXAMPLE = os.path.join(os.path.dirname(TESTS_DIR), "examples", "finetune_lora.py")


@run_once_on("torch", "the SIGTERM path is tested per backend elsewhere")
def test_the_lora_example_survives_a_preemption_mid_epoch(tmp_path):
    backup = str(tmp_path / "backup")
    command = [sys.executable, EXAMPLE, "--backup-dir", backup, "--epochs", "2"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    chief = os.path.join(backup, "chief")
    deadline = time.monotonic() + 240
    while not (
        os.path.isdir(chief) and any(n.startswith("ckpt-") for n in os.listdir(chief))
    ):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # As a preemption notice would.
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "fine-tune finished" not in out
    stopped = [line for line in out.splitlines() if "SIGTERM" in line]
    assert stopped and "backed up epoch 1, batch" in stopped[0], out
    resumed = subprocess.run(
        command, capture_output=True, text=True, env=subprocess_env(), timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at epoch 1/2, batch" in resumed.stdout
    assert "fine-tune finished" in resumed.stdout


def test_reversible_embedding_with_lora_restores_its_own_values(tmp_path):
    """KerasHub's ReversibleEmbedding (untied: an output projection of its
    own), with LoRA: the factors and the frozen table come back as trained."""
    import keras
    import keras_hub

    import keras_ft
    from keras_ft.state.weights_layout import saved_variables

    def model(seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((6,), dtype="int32")
        embedding = keras_hub.layers.ReversibleEmbedding(40, 8, tie_weights=False)
        hidden = embedding(inputs)
        outputs = embedding(hidden, reverse=True)
        built = keras.Model(inputs, outputs)
        embedding.enable_lora(2)
        built.compile(
            keras.optimizers.AdamW(1e-2),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return built

    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, (32, 6)).astype("int32")
    trained = model(1)
    trained.fit(x, x, batch_size=8, epochs=2, verbose=0)
    keras_ft.WorkerTrainingState(trained, str(tmp_path)).back_up(1)
    fresh = model(2)
    fresh.optimizer.build(fresh.trainable_variables)
    keras_ft.WorkerTrainingState(fresh, str(tmp_path)).restore()
    factors = [v for v in trained.weights if "lora_embeddings_b" in v.path]
    assert factors and np.any(keras.ops.convert_to_numpy(factors[0]))
    saved, restored = saved_variables(trained), saved_variables(fresh)
    assert len(saved) == len(restored)
    for a, b in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), err_msg=a.path
        )
