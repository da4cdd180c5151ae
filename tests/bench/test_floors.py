"""The parts of a chunked all-reduce: its additions, as leaves and as a chain, and its assembly."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers import allreduce
from towers.allreduce.machinery.scheduled import generator_of
from towers.allreduce.torus_2d import torus_2d, torus_2d_schedule
from towers.bench import allreduce as bench
from towers.bench import floors
from towers.schedule import ring_schedule
from towers.schedule.ir import Schedule, Step

CHUNKED = ("ring", "swing", "bruck", "pat", "torus_2d", "halving_doubling")


def _values(n: int) -> list[tf.Tensor]:
    values = []
    for i, d in enumerate(DEVICES[:n]):
        with tf.device(d):
            values.append(tf.constant(np.arange(7, dtype="float32") + 10 * i))
    return values


def test_the_parts_are_chunked_work_and_the_chunked_rows_are_marked() -> None:
    contenders = {c.name: c for c in bench.contenders(DEVICES[:3])}
    assert {name for name, c in contenders.items() if c.chunked} == set(CHUNKED)
    assert all((c.schedule is not None) == c.chunked for c in contenders.values())
    values = _values(3)
    adds = floors.leaf_adds(values)
    assert len(adds) == 3 * 2 and all(a.shape == (1, 3) for a in adds)  # ⌈7/3⌉ = 3
    assert np.array_equal(adds[0].numpy(), [[20.0, 22.0, 24.0]])  # tower 2's chunk 0 + tower 0's
    outs = floors.assembly(values)
    assert [o.shape for o in outs] == [(3, 3)] * 3
    for o in outs[1:]:  # one memory: the towers share one write, as the schedules do
        assert np.array_equal(o.numpy(), outs[0].numpy())
    assert np.array_equal(outs[1].numpy().reshape(-1)[:7],
                          [0, 1, 2, 13, 14, 15, 26])  # chunk c from tower c


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_chain_adds_are_the_same_additions_ending_in_every_chunks_sum(n: int) -> None:
    values = _values(n)
    chunks = floors.chain_adds(values)
    total = np.pad(sum(v.numpy() for v in values), (0, -(-7 // n) * n - 7))
    assert len(chunks) == n  # n(n-1) additions, one chain per chunk
    assert np.array_equal(np.concatenate([c.numpy() for c in chunks], axis=None), total)


@pytest.mark.parametrize("n", range(2, 9))
def test_the_leaf_share_lies_between_a_chain_and_a_balanced_tree(n: int) -> None:
    # A chunk's additions are a tree over its n contributions: at least one addition of two
    # contributions, at most ⌊n/2⌋. The ring is the chain, so its share is the least.
    for name in CHUNKED:
        generator = generator_of(allreduce.get(name))
        assert generator is not None, name
        share = floors.leaf_share(generator(n))
        assert 1 / (n - 1) - 1e-12 <= share <= (n // 2) / (n - 1) + 1e-12, (name, n, share)
    assert floors.leaf_share(ring_schedule(n)) == pytest.approx(1 / (n - 1))


def test_the_leaf_share_counts_what_each_addition_reads() -> None:
    # 4 towers, one chunk, a balanced tree: (0+1) and (2+3) are leaves, their sum is not
    tree = Schedule("tree", 4, 1, (
        (Step(1, 0, 0, "reduce"), Step(3, 2, 0, "reduce")),
        (Step(2, 0, 0, "reduce"),),
        (Step(0, 1, 0, "copy"), Step(0, 2, 0, "copy"), Step(0, 3, 0, "copy")),
    ), collective="all_reduce")
    assert floors.leaf_share(tree) == pytest.approx(2 / 3)
    chain = Schedule("chain", 3, 1, (
        (Step(1, 0, 0, "reduce"),), (Step(0, 2, 0, "reduce"),),  # (x0 + x1) + x2: one leaf
        (Step(2, 0, 0, "copy"), Step(2, 1, 0, "copy")),
    ), collective="all_reduce")
    assert floors.leaf_share(chain) == pytest.approx(1 / 2)
    assert generator_of(allreduce.get("naive")) is None
    rings = generator_of(allreduce.ring(subchunks=2))  # its parameters bound
    assert rings is not None and rings(4) == ring_schedule(4, subchunks=2)
    torus = generator_of(torus_2d(rows=3))
    assert torus is not None and torus(6) == torus_2d_schedule(6, rows=3)


def test_in_sequence_prices_the_additions_between_the_two_calibrations() -> None:
    us = {floors.LEAF_ADDS: 130.0, floors.CHAIN_ADDS: 100.0, floors.ASSEMBLY: 35.0}
    assert floors.in_sequence(1 / 3, 4, us) == pytest.approx(135.0)  # a chain: chain adds
    assert floors.in_sequence(1.0, 4, us) == pytest.approx(165.0)  # all leaves
    assert floors.in_sequence(2 / 3, 4, us) == pytest.approx(150.0)
    assert floors.in_sequence(1.0, 2, us) == pytest.approx(165.0)  # 2 towers: one leaf each
