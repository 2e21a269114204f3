"""Values laid out across devices and processes, and the processes'
agreements (`keras_ft/backend/cross_process.py`). Real multi-process
saves and restores: `test_sharded.py`, `test_cluster.py`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
from conftest import run_once_on, subprocess_env

from keras_ft.backend import cross_process


def test_a_value_of_one_process_is_one_whole_piece():
    v = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4))
    assert not cross_process.spans_processes(v)
    assert not cross_process.any_spans_processes([v, v])
    ((bounds, data, first),) = cross_process.held_pieces(v)
    assert bounds == ((0, 0), (3, 4)) and first
    np.testing.assert_array_equal(data, np.arange(12).reshape(3, 4))
    assert cross_process.own_pieces(v)[0][0] == bounds
    assert cross_process.bounds_needed(v, (3, 4)) == [bounds]
    rebuilt = cross_process.build_like(
        v, (3, 4), lambda b: np.full((3, 4), 7.0, "float32")
    )
    v.assign(rebuilt)
    assert float(keras.ops.convert_to_numpy(v).sum()) == 84.0


def test_one_process_agrees_with_itself():
    assert cross_process.all_processes_agree(True)
    assert not cross_process.all_processes_agree(False)
    assert cross_process.least_in_all_processes(5) == 5
    assert cross_process.first_process_value(3) == 3
    assert cross_process.same_in_all_processes(9)


SHARDED = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from keras_ft.backend import cross_process

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    value = np.arange(32, dtype=np.float32).reshape(4, 8)
    # Split over "model", replicated over "data": two distinct pieces, each
    # on two devices; the first replica of each is the one written.
    array = jax.device_put(value, NamedSharding(mesh, P(None, "model")))
    held = cross_process.held_pieces(array)
    own = cross_process.own_pieces(array)
    rebuilt = cross_process.build_like(
        array, (4, 8), lambda b: value[b[0][0]:b[1][0], b[0][1]:b[1][1]] * 2
    )
    print("RESULT " + json.dumps({
        "held": sorted([list(map(list, b)), d.tolist(), f] for b, d, f in held),
        "own": sorted(list(map(list, b)) for b, _ in own),
        "needed": sorted(list(map(list, b)) for b in
                         cross_process.bounds_needed(array, (4, 8))),
        "rebuilt": np.asarray(rebuilt).tolist(),
        "same_layout": rebuilt.sharding == array.sharding,
        "text": cross_process.sharding_text(array),
        "spans": cross_process.spans_processes(array),
    }))
    """
)


@run_once_on("jax", "a JAX array split over devices")
def test_a_sharded_array_is_written_once_per_piece_and_rebuilt_in_place():
    env = {**subprocess_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run([sys.executable, "-c", SHARDED], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    found = json.loads(line[len("RESULT ") :])
    value = np.arange(32, dtype=np.float32).reshape(4, 8)
    halves = [[[0, 0], [4, 4]], [[0, 4], [4, 8]]]
    assert [h[0] for h in found["held"]] == halves  # Each distinct piece once.
    assert [h[1] for h in found["held"]] == [
        value[:, :4].tolist(),
        value[:, 4:].tolist(),
    ]
    assert all(h[2] for h in found["held"]) and found["own"] == halves
    assert found["needed"] == halves
    assert found["rebuilt"] == (value * 2).tolist() and found["same_layout"]
    assert "model" in found["text"] and not found["spans"]  # One process.
