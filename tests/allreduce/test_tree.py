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
    make_arrays,
    place,
)
from tests.conftest import DEVICES
from towers.allreduce.machinery.primitives import record
from towers.allreduce.tree import heap_parents, tree, tree_schedule, tree_shape
from towers.schedule import Step

FOLD = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


def tree_model(arrays: list[np.ndarray], parents: list[int], op: str) -> np.ndarray:
    """The tree's order in NumPy: each node folds its own value, then its children's
    partials in :func:`tree_shape`'s order, left to right; the root finishes."""
    shape = tree_shape(parents)
    partial: dict[int, np.ndarray] = {}
    for node in sorted(range(len(parents)), key=lambda i: -shape.depth[i]):
        acc = arrays[node]
        for child in shape.children[node]:
            acc = FOLD[op](acc, partial[child]).astype(acc.dtype)
        partial[node] = acc
    out = partial[shape.root]
    return (out / out.dtype.type(len(arrays))).astype(out.dtype) if op == "mean" else out


def assert_bitwise(got: np.ndarray, want: np.ndarray, op: str = "sum") -> None:
    """Sums: the same bytes (the order of additions shows in the bits). Max and min: the
    same values; which of ``-0.0`` and ``0.0`` a tie keeps is the kernel's (TensorFlow's
    vectorized and scalar paths differ), not the order's."""
    if op in ("max", "min"):
        np.testing.assert_array_equal(got, want)
    else:
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize(("dtype", "op"), DTYPE_OPS, ids=DTYPE_OP_IDS)
@given(data=st.data())
def test_every_output_matches_the_exact_reduction(dtype: tf.DType, op: str, data: Any) -> None:
    case = data.draw(cases(dtype, op))
    c = data.draw(st.integers(1, 4), label="chunks")
    nbytes = int(np.prod(case.shape)) * dtype.size
    algorithm = tree(c)
    outs = check_all_reduce(
        "tree",
        algorithm,
        case,
        depth=algorithm.summation_depth(case.n),
        expected_bytes=algorithm.bytes_sent(case.n, nbytes, dtype.size),
    )
    want = tree_model(make_arrays(case), heap_parents(case.n), op)
    assert_bitwise(outs[0].numpy(), want, op)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("c", [1, 3])
def test_pieces_move_one_level_per_tick(n: int, c: int) -> None:
    with record() as rec:
        tree(c)(place([np.ones(6, np.float32)] * n))
    parents = heap_parents(n)
    shape = tree_shape(parents)
    top = shape.height[0]
    assert rec.ticks() == (2 * top + c - 1 if n > 1 else 0)
    sent = [(t.tick, DEVICES.index(t.src), DEVICES.index(t.dst), t.chunk) for t in rec.transfers]
    assert sorted(sent) == sorted((tick, s.src, s.dst, s.chunk)  # type: ignore[type-var]
                                  for tick, s in tree_schedule(n, c).steps())
    for t in rec.transfers:
        src, dst = DEVICES.index(t.src), DEVICES.index(t.dst)
        assert t.chunk is not None and t.tick is not None
        if t.note == "reduce":  # height h sends piece k up at tick h + k (or with a sibling)
            assert parents[src] == dst and t.tick >= shape.height[src] + t.chunk
        else:  # depth d copies piece k down at tick D + d + k
            assert t.note == "copy" and parents[dst] == src
            assert t.tick == top + shape.depth[src] + t.chunk


def test_a_child_added_after_a_taller_sibling_sends_with_it() -> None:
    """n = 8: the root adds tower 1's partial (height 2) before tower 2's (height 1, as
    many additions, higher index): tower 2 waits for tick 2, listed after tower 1."""
    assert tree_shape(heap_parents(8)).children[0] == [1, 2]
    ticks = tree_schedule(8).ticks
    assert Step(2, 0, 0, "reduce") not in ticks[1]
    assert ticks[2] == (Step(1, 0, 0, "reduce"), Step(2, 0, 0, "reduce"))
    case = Case(8, (13,), tf.float32, "sum", 5)
    arrays = make_arrays(case)
    assert_bitwise(tree()(place(arrays))[0].numpy(), tree_model(arrays, heap_parents(8), "sum"))


def test_heap_layout_and_byte_formula() -> None:
    assert heap_parents(7) == [-1, 0, 0, 1, 1, 2, 2]
    # 10 float32 over 3 pieces: ceil(10/3) = 4 elements a piece, padding included
    assert tree.bytes_sent(4, 40, 4, chunks=3) == [2 * 3 * 16, 2 * 3 * 16, 3 * 16, 3 * 16]
    assert tree.bytes_sent(1, 40, 4) == [0]


def test_summation_depth_stays_logarithmic() -> None:
    assert tree.summation_depth is not None
    assert [tree.summation_depth(n) for n in range(1, 9)] == [0, 1, 2, 2, 3, 3, 4, 4]
    for n in range(2, 65):
        assert tree.summation_depth(n) == tree_shape(heap_parents(n)).adds[0]
        assert tree.summation_depth(n) <= 2 * (n.bit_length() - 1)


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
