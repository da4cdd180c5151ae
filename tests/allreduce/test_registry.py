"""Every registered algorithm keeps every promise of the contract (properties 1–5).

``check_all_reduce`` draws tower counts 1–8, shapes ((), (0,), primes, sizes no tower
count divides), every dtype and op, and checks each output: the value against the
exact sum within the summation-depth bound, its device, bitwise agreement between
towers, the bytes counted at ``send`` against the module's formula, and — for the
hand-built algorithms — bitwise equality with the NumPy replay of the traced graph.
TensorFlow's collectives are opaque to the replay (the runtime picks their order).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS
from towers.testing import check_all_reduce

OPAQUE = {"nccl", "nccl_ring", "nccl_tree"}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_registered_algorithm_keeps_the_contract(name: str) -> None:
    # hierarchical's default group_size=2 must divide the tower count.
    counts = [2, 4, 6, 8] if name == "hierarchical" else None
    report = check_all_reduce(
        name, max_examples=16, replay=name not in OPAQUE, tower_counts=counts, devices=DEVICES
    )
    assert report.ok, str(report)


def test_unknown_names_list_the_registry() -> None:
    with tf.device(DEVICES[0]):
        x = tf.ones([2])
    with pytest.raises(ValueError, match=r"registered: .*ring"):
        towers.all_reduce([x], algorithm="butterfly")


def test_every_registered_factory_builds_with_defaults() -> None:
    for name, factory in ALGORITHMS.items():
        assert callable(factory()), name


def test_naive_chains_large_buffers_with_the_same_bits() -> None:
    """Above 16 MB naive adds pairwise instead of with AddN: same order, same bits."""
    from towers.allreduce import naive
    from towers.testing.replay import replay

    rng = np.random.default_rng(0)
    n, size = 3, 5 * 2**20  # 20 MB of float32 per tower
    arrays = [rng.normal(size=size).astype(np.float32) for _ in range(n)]
    values = []
    for a, d in zip(arrays, DEVICES[:n]):
        with tf.device(d):
            values.append(tf.constant(a))
    out = towers.all_reduce(values, algorithm="naive")
    sequential = (arrays[0] + arrays[1]) + arrays[2]
    for o in out:
        np.testing.assert_array_equal(o.numpy(), sequential)
    np.testing.assert_array_equal(replay(naive, arrays, devices=DEVICES[:n])[0], sequential)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_bad_input_is_named(name: str) -> None:
    """The contract's checks, for every algorithm: empty, shapes (naming the towers), one
    device twice, an unknown op, an integer mean."""
    algo = ALGORITHMS[name]()
    with pytest.raises(ValueError, match="values is empty"):
        algo([])
    values = []
    for d, shape in zip(DEVICES[:3], [[3], [3], [4]]):
        with tf.device(d):
            values.append(tf.zeros(shape))
    with pytest.raises(ValueError, match=r"tower 0 has \(3,\), tower 2 \(4,\)"):
        algo(values)
    with pytest.raises(ValueError, match="both on"):
        algo([values[0], values[0]])
    with pytest.raises(ValueError, match="op must be one of"):
        algo(values[:2], op="prod")
    ints = []
    for d in DEVICES[:2]:
        with tf.device(d):
            ints.append(tf.zeros([2], tf.int32))
    with pytest.raises(ValueError, match="not defined for integer"):
        algo(ints, op="mean")
