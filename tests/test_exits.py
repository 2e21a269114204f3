"""A lost peer's error ends the process with the retryable status; any other
error keeps Python's own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import run_once_on, subprocess_env

from keras_ft.training import exits

ONCE = run_once_on("jax", "an excepthook; the backend does not matter")

GLOO = (
    "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
    "pair.cc:538] Read error [127.0.0.1]:9415: Connection reset by peer"
)
UNHEALTHY = (
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The "
    "following tasks are unhealthy (stopped sending heartbeats)"
)


@ONCE
def test_the_frameworks_errors_for_a_lost_peer_are_recognized():
    import jax
    import tensorflow as tf

    assert "JaxRuntimeError" in exits.lost_peer(jax.errors.JaxRuntimeError(GLOO))
    assert "UnavailableError" in exits.lost_peer(
        tf.errors.UnavailableError(None, None, UNHEALTHY)
    )
    # Raised from one: a wrapper keeps its cause.
    try:
        try:
            raise tf.errors.DeadlineExceededError(None, None, "barrier")
        except tf.errors.DeadlineExceededError as e:
            raise RuntimeError("fit() failed") from e
    except RuntimeError as e:
        assert "DeadlineExceededError" in exits.lost_peer(e)
    # A user's mistake is not a lost peer, whatever its framework.
    invalid = jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shape")
    assert exits.lost_peer(invalid) is None
    assert exits.lost_peer(tf.errors.InvalidArgumentError(None, None, "x")) is None
    assert exits.lost_peer(ValueError("Connection reset by peer")) is None
    assert exits.lost_peer(None) is None


SCRIPT = """
import sys
from keras_ft.training import exits
exits.exit_retryably_on_lost_peer()
exits.exit_retryably_on_lost_peer()  # Chained once.
print("trained", flush=False)  # Flushed before the exit.
if sys.argv[1] == "peer":
    import jax
    raise jax.errors.JaxRuntimeError({gloo!r})
raise ValueError("a bug in the model")
"""


@ONCE
@pytest.mark.parametrize("kind, status", [("peer", 75), ("bug", 1)])
def test_an_uncaught_error_ends_the_process_with_its_status(tmp_path, kind, status):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(gloo=GLOO)))
    done = subprocess.run(
        [sys.executable, str(script), kind],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "trained\n"
    assert "Traceback (most recent call last)" in done.stderr  # Printed as usual.
    said = "Exiting with status 75 (retryable)"
    assert (said in done.stderr) == (kind == "peer")
    assert done.stderr.count("Traceback") == 1


@ONCE
def test_the_documented_scheduler_policies_use_the_codes_keras_ft_exits_with():
    """The YAML in docs/internals.md parses, and its exit codes are the ones
    the package uses: preempted, retryable (a stall or a lost peer, or JAX's
    abort), and a bug."""
    import re
    import signal

    import yaml
    from conftest import TESTS_DIR

    with open(f"{TESTS_DIR}/../docs/internals.md") as f:
        blocks = re.findall(r"```yaml\n(.*?)```", f.read(), re.S)
    policies = [yaml.safe_load(textwrap.dedent(block)) for block in blocks]
    pod = next(p["podFailurePolicy"] for p in policies if "podFailurePolicy" in p)
    codes = {r["action"]: r["onExitCodes"]["values"] for r in pod["rules"]}
    assert codes == {
        "Ignore": [128 + signal.SIGTERM],
        "Count": [exits.RETRYABLE_EXIT_CODE, 128 + signal.SIGABRT],
        "FailJob": [1],
    }
    jobset = next(p for p in policies if "failurePolicy" in p)
    [job] = jobset["replicatedJobs"]
    assert job["template"]["spec"]["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [1]}}
    ]
    assert jobset["failurePolicy"]["rules"][0]["action"] == "FailJobSet"
