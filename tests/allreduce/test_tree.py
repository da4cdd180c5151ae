"""Binary-tree all-reduce: every output against the exact reduction, bytes, schedule, bad input."""

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
    place,
)
from tests.conftest import DEVICES
from towers.allreduce.machinery.primitives import record
from towers.allreduce.tree import (
    bytes_sent,
    heap_parents,
    summation_depth,
    tree,
    tree_shape,
)


@pytest.mark.parametrize(("dtype", "op"), DTYPE_OPS, ids=DTYPE_OP_IDS)
@given(data=st.data())
def test_every_output_matches_the_exact_reduction(dtype: tf.DType, op: str, data: Any) -> None:
    case = data.draw(cases(dtype, op))
    c = data.draw(st.integers(1, 4), label="chunks")
    nbytes = int(np.prod(case.shape)) * dtype.size
    check_all_reduce(
        "tree",
        tree(c),
        case,
        depth=summation_depth(case.n, c),
        expected_bytes=bytes_sent(case.n, nbytes, dtype.size, c),
    )


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("c", [1, 3])
def test_pieces_move_one_level_per_tick(n: int, c: int) -> None:
    with record() as rec:
        tree(c)(place([np.ones(6, np.float32)] * n))
    parents = heap_parents(n)
    shape = tree_shape(parents)
    top = shape.height[0]
    assert rec.ticks() == (2 * top + c - 1 if n > 1 else 0)
    for t in rec.transfers:
        src, dst = DEVICES.index(t.src), DEVICES.index(t.dst)
        assert t.chunk is not None and t.tick is not None
        if t.note == "reduce":  # height h sends piece k up at tick h + k
            assert parents[src] == dst and t.tick == shape.height[src] + t.chunk
        else:  # depth d copies piece k down at tick D + d + k
            assert t.note == "broadcast" and parents[dst] == src
            assert t.tick == top + shape.depth[src] + t.chunk


def test_heap_layout_and_byte_formula() -> None:
    assert heap_parents(7) == [-1, 0, 0, 1, 1, 2, 2]
    # 10 float32 over 3 pieces: ceil(10/3) = 4 elements a piece, padding included
    assert bytes_sent(4, 40, 4, 3) == [2 * 3 * 16, 2 * 3 * 16, 3 * 16, 3 * 16]
    assert bytes_sent(1, 40, 4) == [0]


def test_summation_depth_stays_logarithmic() -> None:
    assert [summation_depth(n) for n in range(1, 9)] == [0, 1, 2, 2, 3, 3, 4, 4]
    for n in range(2, 65):
        assert summation_depth(n) <= 2 * (n.bit_length() - 1)


def test_tree_shape_refuses_non_trees() -> None:
    with pytest.raises(ValueError, match="one root"):
        tree_shape([-1, -1])
    with pytest.raises(ValueError, match="not a tree"):
        tree_shape([-1, 2, 1])
    with pytest.raises(ValueError, match="not a tree"):
        tree_shape([-1, 5])


@pytest.mark.parametrize("op", ["sum", "mean", "min"])
def test_one_tf_function_uses_plain_ops_and_stays_within_the_bound(op: str) -> None:
    # grappler may fuse a node's two adds into one AddN in any order: <= 2 adds per level
    graph_depth = 2 * tree_shape(heap_parents(6)).height[0]
    assert_traced_graph_is_sound(tree(3), Case(6, (13,), tf.float32, op, 3), graph_depth)


@pytest.mark.parametrize("chunks", [0, -2, 2.0, "1", True, None])
def test_bad_chunks_are_refused(chunks: Any) -> None:
    with pytest.raises(ValueError, match="chunks"):
        tree(chunks)


def test_base_checks() -> None:
    assert_base_checks(tree())
    assert_base_checks(tree(4))
