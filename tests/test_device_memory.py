"""`backend.device_memory`: a snapshot on the device, and its move into host
memory in order, in pieces on JAX, stopped between arrays when told."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_ft.backend import device_memory, finiteness


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's own move")
def test_jax_moves_a_snapshot_to_host_memory_in_pieces(monkeypatch):
    """On an accelerator JAX lands each transfer in host memory of its own:
    the snapshot moves in pieces (here, on the CPU, as if it were one), and
    each device copy is let go once moved."""
    import jax.numpy as jnp

    monkeypatch.setattr(device_memory, "_read_in_place", lambda array: False)
    monkeypatch.setattr(device_memory, "_MOVE_PIECE", 1000)
    rng = np.random.default_rng(0)
    values = [
        jnp.asarray(rng.normal(size=(37, 29)).astype("float32")),  # 8 rows a piece.
        jnp.asarray(rng.normal(size=(601,))).astype("bfloat16"),
        jnp.asarray(rng.normal(size=(3, 400)).astype("float32")),  # A row a piece.
        jnp.asarray(rng.normal(size=(2, 5, 7)).astype("float32")),
        jnp.zeros((0, 3)),
        jnp.zeros((3, 0)),
        jnp.asarray(7, "int32"),
    ]
    copies, made = device_memory.device_snapshot(values)
    made()
    destinations = [np.empty(v.shape, v.dtype) for v in copies]
    device_memory.move_to_host(copies, destinations)
    assert copies == [None] * len(values)
    for value, moved in zip(values, destinations, strict=True):
        np.testing.assert_array_equal(moved, np.asarray(value))
        assert moved.dtype == np.asarray(value).dtype


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's sharded saves")
def test_each_device_checks_its_pieces_of_a_snapshot():
    """A sharded save checks its snapshot on the devices: the values with a
    NaN or an infinity anywhere are named, whatever their floating type."""
    import jax.numpy as jnp

    values = [
        jnp.ones((4, 3)),
        jnp.ones((4, 3)).at[3, 2].set(jnp.nan),
        jnp.asarray([1.0, -jnp.inf], "bfloat16"),
        jnp.asarray([7, 8], "int32"),
        jnp.zeros((0, 3)),
        jnp.asarray([jnp.inf], "float16"),
        jnp.asarray(2.0),
    ]
    copies, _ = device_memory.device_snapshot(values)
    assert finiteness.non_finite_pieces(copies) == {1, 2, 5}
    assert finiteness.non_finite_pieces(copies[:1] + copies[3:5]) == set()
    assert device_memory.shard_shape(values[1]) == (4, 3)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "in pieces"])
def test_a_move_says_when_each_value_has_landed(monkeypatch, pieces):
    """`landed(i)` comes once all of the i-th destination has landed, in
    order, and not before."""
    if pieces:
        if keras.backend.backend() != "jax":
            pytest.skip("JAX's own move in pieces")
        monkeypatch.setattr(device_memory, "_read_in_place", lambda array: False)
        monkeypatch.setattr(device_memory, "_MOVE_PIECE", 1000)
    rng = np.random.default_rng(0)
    values = [rng.normal(size=shape).astype("float32")
              for shape in [(37, 29), (5,), (3, 400), (0, 3), ()]]  # fmt: skip
    copies, made = device_memory.device_snapshot(
        [keras.ops.convert_to_tensor(v) for v in values]
    )
    made()
    destinations = [np.zeros_like(v) for v in values]
    told = []

    def landed(i):
        np.testing.assert_array_equal(destinations[i], values[i])
        if i + 1 < len(values) and destinations[i + 1].size:
            assert not destinations[i + 1].any(), i  # The next one not yet.
        told.append(i)

    assert device_memory.move_to_host(copies, destinations, landed=landed)
    assert told == list(range(len(values)))


def test_a_move_stops_between_arrays_when_told():
    values = [keras.ops.arange(10.0), keras.ops.arange(5.0)]
    copies, made = device_memory.device_snapshot(
        [device_memory.raw_value(v) for v in values]
    )
    made()
    values = [keras.ops.convert_to_numpy(v) for v in values]
    destinations = [np.zeros_like(v) for v in values]
    asked = []

    def stopped() -> bool:
        asked.append(1)
        return len(asked) > 1  # After the first array.

    assert device_memory.move_to_host(copies, destinations, stopped) is False
    np.testing.assert_array_equal(destinations[0], values[0])
    np.testing.assert_array_equal(destinations[1], np.zeros(5))
