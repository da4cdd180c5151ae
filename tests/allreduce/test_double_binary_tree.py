"""Double binary tree all-reduce: the two NCCL trees, every output, bytes, bad input."""

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
from tests.allreduce.test_tree import assert_bitwise, tree_model
from tests.conftest import DEVICES
from towers.allreduce.double_binary_tree import (
    btree_parents,
    double_binary_tree,
    double_trees,
)
from towers.allreduce.machinery.primitives import record
from towers.allreduce.tree import tree_shape


def model(arrays: list[np.ndarray], op: str, chunks: int) -> np.ndarray:
    """Both trees' orders in NumPy: the first ``chunks`` of ``2·chunks`` padded pieces
    through tree A, the rest through tree B (flattened)."""
    flat = [a.reshape(-1) for a in arrays]
    piece = max(1, -(-flat[0].size // (2 * chunks)))
    first, second = (tree_model(flat, parents, op) for parents in double_trees(len(arrays)))
    return np.where(np.arange(flat[0].size) // piece < chunks, first, second)


@pytest.mark.parametrize(("dtype", "op"), DTYPE_OPS, ids=DTYPE_OP_IDS)
@given(data=st.data())
def test_every_output_matches_the_exact_reduction(dtype: tf.DType, op: str, data: Any) -> None:
    case = data.draw(cases(dtype, op))
    c = data.draw(st.integers(1, 2), label="chunks")
    nbytes = int(np.prod(case.shape)) * dtype.size
    algorithm = double_binary_tree(c)
    outs = check_all_reduce(
        "double_binary_tree",
        algorithm,
        case,
        depth=algorithm.summation_depth(case.n),
        expected_bytes=algorithm.bytes_sent(case.n, nbytes, dtype.size),
    )
    assert_bitwise(outs[0].numpy().reshape(-1), model(make_arrays(case), op, c), op)


def test_the_trees_drawn_in_the_docstring() -> None:
    first, second = double_trees(8)
    assert first == [-1, 2, 4, 2, 0, 6, 4, 6]  # 0 ─ 4 ─ {2 ─ {1, 3}, 6 ─ {5, 7}}
    assert second == [1, 3, 1, 7, 5, 3, 5, -1]  # 7 ─ 3 ─ {5 ─ {6, 4}, 1 ─ {2, 0}}
    assert btree_parents(14)[13] == 12 and btree_parents(14)[8] == 0  # NCCL's illustration
    assert double_trees(7)[1] == [5, -1, 3, 5, 3, 1, 0]  # odd n: A shifted by one


@pytest.mark.parametrize("n", range(1, 65))
def test_trees_are_binary_and_complementary(n: int) -> None:
    inner = []
    for parents in double_trees(n):
        shape = tree_shape(parents)
        assert all(len(kids) <= 2 for kids in shape.children)
        inner.append({i for i in range(n) if shape.children[i]})
    if n % 2 == 0:  # inner in one tree, leaf in the other
        assert not inner[0] & inner[1] and inner[0] | inner[1] == set(range(n))
    else:  # only tower 0 is inner in both (tree A's root, tree B's image of n - 1)
        assert inner[0] & inner[1] <= {0}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_each_half_travels_its_own_tree(n: int) -> None:
    with record() as rec:
        double_binary_tree()(place([np.ones(10, np.float32)] * n))
    trees = double_trees(n)
    for t in rec.transfers:
        assert t.chunk in (0, 1)
        src, dst = DEVICES.index(t.src), DEVICES.index(t.dst)
        assert trees[t.chunk][src] == dst or trees[t.chunk][dst] == src
    assert rec.ticks() == (2 * tree_shape(trees[0]).height[trees[0].index(-1)] if n > 1 else 0)


def test_byte_formula_and_depth() -> None:
    # 8 towers, 16 float32: halves of 8 elements (32 bytes); inner+leaf sends 3 + 1 halves
    record, depth = double_binary_tree.bytes_sent, double_binary_tree.summation_depth
    assert record is not None and depth is not None
    sent = record(8, 64, 4)
    assert sent is not None and sent[4] == 4 * 32 and sent[0] == 2 * 32
    for n in range(1, 65):  # no tower sends more than 2S: inner in one tree, leaf in the other
        assert max(record(n, 64, 4) or [0]) <= 2 * 64
        assert depth(n) == max(tree_shape(p).adds[p.index(-1)] for p in double_trees(n))
    assert record(3, 12, 4, chunks=2) == record(3, 16, 4, chunks=2)  # 3 vs 4 elements: padding
    assert depth(8) == 5 and depth(1) == 0


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_one_tf_function_uses_plain_ops_and_stays_within_the_bound(op: str) -> None:
    # grappler may fuse a node's two adds into one AddN in any order: <= 2 adds per level
    graph_depth = max(2 * max(tree_shape(p).height) for p in double_trees(7))
    case = Case(7, (5, 3), tf.float32, op, 11)  # this case regroups: traced != eager
    assert_traced_graph_is_sound(double_binary_tree(2), case, graph_depth)


@pytest.mark.parametrize("chunks", [0, -1, 1.5, "1", True])
def test_bad_chunks_are_refused(chunks: Any) -> None:
    with pytest.raises(ValueError, match="chunks"):
        double_binary_tree(chunks)


def test_base_checks() -> None:
    assert_base_checks(double_binary_tree())
