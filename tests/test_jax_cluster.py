"""The integers a JAX cluster's processes agree on, through its coordination
service (`keras_ft/compat/jax_cluster.py`): two real processes on 127.0.0.1.
The agreements of whole trainings: `test_sharded.py`, `test_cluster.py`."""

from __future__ import annotations

import textwrap

from conftest import run_once_on, run_two_processes, subprocess_env

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


@ONCE
def test_each_call_gathers_every_process_value_in_process_order():
    results = run_two_processes(PROCESS, subprocess_env(), timeout=240)
    expected = [[10 * call, 10 * call + 1] for call in range(5)]
    # The n-th call of each process met the n-th of the other (keys of
    # calls two back deleted on the way); without the service, the caller
    # is told to gather through XLA.
    assert [r["rounds"] for r in results] == [expected, expected]
    assert [r["fallback"] for r in results] == [None, None]
