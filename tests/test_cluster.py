"""Roles and directories: who writes where."""

from __future__ import annotations

import json
import os

import pytest

from keras_ft.checkpoint.format import chief_directory
from keras_ft.checkpoint.store import CheckpointStore
from keras_ft.distribute.cluster import (
    TaskSpec,
    current_task,
    worker_temp_name,
)


def tf_config(cluster, task_type, index):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "evaluator": ["h:4"]}


def test_chief_task_is_chief():
    spec = TaskSpec.from_tf_config(tf_config(CLUSTER, "chief", 0))
    assert spec == TaskSpec("chief", 0, 3, True)


def test_workers_are_not_chief_when_a_chief_exists():
    spec = TaskSpec.from_tf_config(tf_config(CLUSTER, "worker", 0))
    assert spec == TaskSpec("worker", 0, 3, False)


def test_a_tfjob_tf_config_names_the_chief_and_the_workers():
    """`TF_CONFIG` as Kubeflow's TFJob operator writes it in each pod."""
    cluster = {
        "chief": ["run-chief-0.team.svc:2222"],
        "worker": ["run-worker-0.team.svc:2222", "run-worker-1.team.svc:2222"],
    }

    def pod(task_type, index):
        return json.dumps({
            "cluster": cluster, "task": {"type": task_type, "index": index},
            "environment": "cloud",
        })  # fmt: skip

    assert TaskSpec.from_tf_config(pod("chief", 0)) == TaskSpec("chief", 0, 3, True)
    assert TaskSpec.from_tf_config(pod("worker", 1)) == TaskSpec("worker", 1, 3, False)


def test_worker_zero_is_chief_without_a_chief_task():
    cluster = {"worker": ["h:1", "h:2"]}
    assert TaskSpec.from_tf_config(tf_config(cluster, "worker", 0)).is_chief
    assert not TaskSpec.from_tf_config(tf_config(cluster, "worker", 1)).is_chief


def test_evaluator_is_never_chief():
    spec = TaskSpec.from_tf_config(tf_config(CLUSTER, "evaluator", 0))
    assert spec.task_type == "evaluator" and not spec.is_chief


def test_empty_tf_config_is_a_single_chief():
    assert TaskSpec.from_tf_config("{}") == TaskSpec()


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"cluster": [], "task": {"type": "worker"}}', "must be JSON objects"),
        ('{"cluster": {"worker": ["a"]}, "task": {"index": 0}}', '"type"'),
    ],
)
def test_malformed_tf_config_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message) as info:
        TaskSpec.from_tf_config(text)
    assert "TF_CONFIG" in str(info.value)


def test_single_process_is_chief(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert current_task() == TaskSpec()


def test_directories(tmp_path):
    root = str(tmp_path)
    assert chief_directory(root) == os.path.join(root, "chief")
    assert chief_directory("s3://bucket/run/") == "s3://bucket/run/chief"
    assert chief_directory(f"file://{root}") == os.path.join(root, "chief")
    # A worker's throwaway saves: beside the chief's directory on a disk.
    storage = CheckpointStore(chief_directory(root)).storage
    assert storage.housekeeping.scratch_dir(worker_temp_name(2)) == os.path.join(
        root, "workertemp_2"
    )
