"""Ring all-reduce: every output against the exact reduction, bytes, schedule, bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tests.allreduce.machinery.test_primitives import (
    DTYPE_OP_IDS,
    DTYPE_OPS,
    Case,
    assert_base_checks,
    assert_traced_graph_is_sound,
    cases,
    check_all_reduce,
    make_arrays,
    place,
)
from tests.allreduce.test_tree import FOLD, assert_bitwise
from tests.conftest import DEVICES
from towers.allreduce.machinery.primitives import record
from towers.allreduce.ring import ring
from towers.schedule import ring_orders


@pytest.mark.parametrize(("dtype", "op"), DTYPE_OPS, ids=DTYPE_OP_IDS)
@given(data=st.data())
def test_every_output_matches_the_exact_reduction(dtype: tf.DType, op: str, data: Any) -> None:
    case = data.draw(cases(dtype, op))
    s = data.draw(st.integers(1, 3), label="subchunks")
    nbytes = int(np.prod(case.shape)) * dtype.size
    algorithm = ring(s)
    depth = algorithm.summation_depth(case.n)
    sent = algorithm.bytes_sent(case.n, nbytes, dtype.size)
    assert depth == max(case.n - 1, 0)  # a chain round the ring
    chunk = -(-int(np.prod(case.shape)) // (case.n * s))  # padding included
    assert sent == [2 * (case.n - 1) * s * chunk * dtype.size] * case.n
    check_all_reduce("ring", algorithm, case, depth=depth, expected_bytes=sent)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_each_tower_sends_2_n_minus_1_over_n_of_the_buffer(n: int, s: int) -> None:
    size = 4 * n * s  # divides evenly: no padding, so the formula is exact
    nbytes = size * 4
    with record() as rec:
        ring(s)(place([np.ones(size, np.float32)] * n))
    sent = rec.bytes_sent()
    assert [sent.get(d, 0) for d in DEVICES[:n]] == [2 * (n - 1) * nbytes // n] * n
    assert ring(s).bytes_sent(n, nbytes, 4) == [2 * (n - 1) * nbytes // n] * n
    assert rec.ticks() == 2 * (n - 1)


def test_padding_is_counted_when_the_size_does_not_divide() -> None:
    # 5 elements over 4 towers and 2 rings: chunks of ceil(5/8) = 1 element, 3 of them zeros
    assert ring.bytes_sent(4, 20, 4, subchunks=2) == [2 * 3 * 2 * 1 * 4] * 4
    assert ring.bytes_sent(3, 0, 8) == [0, 0, 0]
    assert ring.bytes_sent(1, 400, 4) == [0]


@pytest.mark.parametrize(("n", "s"), [(4, 1), (4, 2), (5, 3), (3, 4)])
def test_schedule_follows_the_index_formula(n: int, s: int) -> None:
    with record() as rec:
        ring(s)(place([np.ones(2 * n * s, np.float32)] * n))
    orders = ring_orders(n, s)
    assert len(rec.transfers) == 2 * (n - 1) * n * s
    for t in rec.transfers:
        assert t.chunk is not None and t.tick is not None
        g, r = divmod(t.chunk, s)  # chunk g·s + r is segment g of ring r
        p = orders[r].index(DEVICES.index(t.src))
        assert DEVICES.index(t.dst) == orders[r][(p + 1) % n]  # right-hand neighbour
        if t.tick < n - 1:  # reduce-scatter
            assert t.note == "reduce" and g == (p - 1 - t.tick) % n
        else:  # all-gather
            assert t.note == "copy" and g == (p - (t.tick - (n - 1))) % n


def ring_model(arrays: list[np.ndarray], op: str, s: int) -> np.ndarray:
    """The ring's order in NumPy: segment ``g`` of ring ``r`` (chunk ``g·s + r``) is the left
    fold of the towers from ring position ``g + 1`` round to ``g``; mean divides once."""
    n, flat = len(arrays), [a.reshape(-1) for a in arrays]
    piece = max(1, -(-flat[0].size // (n * s)))
    out = np.empty_like(flat[0])
    for j in range(flat[0].size):
        g, r = divmod(j // piece, s)
        order = ring_orders(n, s)[r]
        acc = flat[order[(g + 1) % n]][j]
        for p in range(g + 2, g + n + 1):
            acc = FOLD[op](acc, flat[order[p % n]][j]).astype(acc.dtype)
        out[j] = acc / acc.dtype.type(n) if op == "mean" else acc
    return out


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_every_chunk_is_added_round_its_ring(op: str, s: int) -> None:
    for n in (1, 2, 3, 5, 8):
        arrays = make_arrays(Case(n, (3, 7), tf.float32, op, n + s))
        got = ring(s)(place(arrays), op=op)[0].numpy().reshape(-1)
        assert_bitwise(got, ring_model(arrays, op, s), op)


def test_rings_are_rotated() -> None:
    assert ring_orders(4, 2) == [[0, 1, 2, 3], [2, 3, 0, 1]]
    assert ring_orders(8, 4) == [[(p + 2 * r) % 8 for p in range(8)] for r in range(4)]
    assert ring_orders(2, 3) == [[0, 1], [1, 0], [0, 1]]  # more rings than towers: wraps


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_one_tf_function_uses_plain_ops_and_keeps_the_order(op: str) -> None:
    case = Case(5, (3, 7), tf.float32, op, 7)
    traced, eager = assert_traced_graph_is_sound(ring(2), case, 4)
    if op == "sum":  # one add per device per chunk and tick: nothing for grappler to regroup
        assert traced.tobytes() == eager.tobytes()


def test_summation_depth_is_a_chain() -> None:
    assert [ring.summation_depth(n, subchunks=2) for n in range(1, 9)] == list(range(8))


@pytest.mark.parametrize("subchunks", [0, -1, 1.5, "2", True, None])
def test_bad_subchunks_are_refused(subchunks: Any) -> None:
    with pytest.raises(ValueError, match="subchunks"):
        ring(subchunks)


def test_base_checks() -> None:
    assert_base_checks(ring())
    assert_base_checks(ring(3))
