"""JAX's coordination service: the few integers a cluster's processes agree on.

keras-ft's agreements between the processes of a JAX cluster (which
checkpoint to restore, whether every process read it intact, a checkpoint's
number) are single integers. The public way, `multihost_utils.
process_allgather()`, compiles and runs an XLA all-gather: about 100 ms the
first time in a process and 3-10 ms each time after, on the critical path of
every restore. The key-value store of the coordination service that
`jax.distributed.initialize()` started answers in about a millisecond; its
client is a private name of JAX.

A dead or frozen peer ends a process waiting in the store the way it ends
one waiting in an all-gather: the service stops every process once the
peer's heartbeats stop. The wait releases the GIL, so keras-ft's watchdog
and signal handlers run meanwhile.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from keras_ft.compat.registry import register, usable

_PREFIX = "keras_ft/gather"
# As good as no bound: the other processes may be writing or downloading a
# big checkpoint first. A dead peer ends the wait through the heartbeats.
_TIMEOUT_MS = 2**31 - 1
# The calls so far with this client: a cluster started afresh in the same
# processes (`jax.distributed.shutdown()`, then `initialize()`) counts anew.
_calls: dict[int, itertools.count] = {}


def _in_a_jax_cluster() -> bool:
    import keras

    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.process_count() > 1


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


@register(
    "cluster_key_value",
    "the agreements between the processes of a JAX cluster (which checkpoint "
    "to restore, whether every process read it) run as XLA all-gathers, about "
    "100 ms the first time and 3-10 ms each after, instead of about 1 ms",
    applies=_in_a_jax_cluster,
)
def _check_cluster_key_value() -> bool:
    client = _client()
    return client is not None and all(
        callable(getattr(client, name, None))
        for name in ("key_value_set", "blocking_key_value_get", "key_value_delete")
    )


def gather_ints(value: int) -> np.ndarray | None:
    """`value` from every process of the JAX cluster, in process order, or
    `None` where the coordination service cannot be used (the caller then
    gathers through XLA).

    A collective: every process calls it, in the same order; the n-th call
    of each process meets the n-th call of the others. Whether the service is
    used is decided the same way in every process (the same installation),
    so no process waits in the store for one gone through XLA.
    """
    if not usable("cluster_key_value"):
        return None
    import jax

    client = _client()
    if id(client) not in _calls:
        _calls.clear()
        _calls[id(client)] = itertools.count()
    call = next(_calls[id(client)])
    me, count = jax.process_index(), jax.process_count()
    client.key_value_set(f"{_PREFIX}/{call}/{me}", str(int(value)))
    values = [
        int(client.blocking_key_value_get(f"{_PREFIX}/{call}/{p}", _TIMEOUT_MS))
        for p in range(count)
    ]
    if call >= 2:
        # Every process has set its key of the call before this one, so has
        # read all the keys of the call before that: none waits for them.
        client.key_value_delete(f"{_PREFIX}/{call - 2}/{me}")
    return np.asarray(values, np.int64)
