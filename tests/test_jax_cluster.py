"""The integers a JAX cluster's processes agree on, through its coordination
service (`keras_ft/compat/jax_cluster.py`): two real processes on 127.0.0.1.
The agreements of whole trainings: `test_sharded.py`, `test_cluster.py`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

from conftest import run_once_on, subprocess_env

ONCE = run_once_on("jax", "a JAX cluster")

PROCESS = textwrap.dedent(
    """
    import json, sys
    import keras_ft
    from keras_ft.compat import jax_cluster, registry

    index, port = int(sys.argv[1]), int(sys.argv[2])
    keras_ft.initialize_cluster(coordinator_address=f"127.0.0.1:{port}",
                                num_processes=2, process_id=index)
    rounds = [jax_cluster.gather_ints(10 * call + index).tolist()
              for call in range(5)]
    with registry.disabled("cluster_key_value"):
        fallback = jax_cluster.gather_ints(7)
    print("RESULT " + json.dumps({"rounds": rounds, "fallback": fallback}))
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ONCE
def test_each_call_gathers_every_process_value_in_process_order():
    port = free_port()
    env = subprocess_env()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(i), str(port)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    results = []
    for process in processes:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    expected = [[10 * call, 10 * call + 1] for call in range(5)]
    # The n-th call of each process met the n-th of the other (keys of
    # calls two back deleted on the way); without the service, the caller
    # is told to gather through XLA.
    assert [r["rounds"] for r in results] == [expected, expected]
    assert [r["fallback"] for r in results] == [None, None]
