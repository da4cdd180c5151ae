"""Double binary tree all-reduce (NCCL's "tree"): two complementary trees, half the data each.

One binary tree makes its inner nodes do all the sending (a leaf sends one
value, an inner node three). NCCL builds two trees over the same towers so that
a tower inner in one is a leaf in the other, and reduces-then-broadcasts one
half of the data through each tree at the same time.

Tree A (NCCL's ``ncclGetBtree``, root 0): tower ``r > 0`` with lowest set bit
``b`` has parent ``(r ^ b) | 2b``, or ``r ^ b`` when that is out of range; the
root's one child is the largest power of two below ``n``. Tree B is A mirrored
(``r -> n-1-r``) when ``n`` is even and A shifted (``r -> r+1 mod n``) when it
is odd. n = 8::

    tree A (half 0)                     tree B (half 1, mirrored)
    0                                   7
    └── 4                               └── 3
        ├── 2                               ├── 5
        │   ├── 1                           │   ├── 6
        │   └── 3                           │   └── 4
        └── 6                               └── 1
            ├── 5                               ├── 2
            └── 7                               └── 0

    inner in A: 0 4 2 6  (leaves 1 3 5 7)   inner in B: 7 3 5 1  (leaves 6 4 2 0)

For even ``n`` every tower is inner in one tree and a leaf in the other; for odd
``n`` tower 0 is inner in both (A's root, and B's image of ``n-1``), every other
tower is a leaf in one of them.

Schedule: both trees run at once, each half as in :mod:`towers.allreduce.tree`
(half ``h``'s piece ``k`` is chunk ``h·C + k``): a node of height ``h`` sends
piece ``k`` up at tick ``h + k``; a node at depth ``d`` copies it down at tick
``D + d + k``. n = 4, C = 1 (A: 0─2─{1,3}; B mirrored: 3─1─{2,0})::

    tick        0                1            2             3
    tower 0   c1 ▲1             .          c0 ▼2            .
    tower 1   c0 ▲2           c1 ▲3          .           c1 ▼0,2
    tower 2   c1 ▲1           c0 ▲0          .           c0 ▼1,3
    tower 3   c0 ▲2             .          c1 ▼1            .

Order: as in :mod:`towers.allreduce.tree` (eager; a ``tf.function`` may regroup a
node's two additions, up to ``2·D``); :func:`summation_depth` is the larger of the
two trees' depths.

Cost (n towers, S bytes, D = tree height ≈ log2 n; single-port full-duplex links
as in :mod:`towers.bench.costmodel`): ``2D + C - 1`` ticks, both trees at once. A tower
sends at most ``2S`` (``3·S/2`` as an inner node, ``S/2`` as a leaf), like the
ring's ``2(n-1)/n·S``, with ``2D`` instead of ``2(n-1)`` latency terms. C = 1: an
inner node takes two halves per level, ``4D·(α + S/2·β) + D·S·γ``; pipelining
trades α for β as in the single tree, with pieces of ``S/(2C)``.

References:
    P. Sanders, J. Speck, J. L. Träff, "Two-tree algorithms for full bandwidth
    broadcast, reduction and scan", Parallel Computing 35(12), 2009. S. Jeaugey,
    "Massively scale your deep learning training with NCCL 2.4", NVIDIA blog, 2019;
    NCCL ``src/graph/trees.cc`` (``ncclGetBtree``, ``ncclGetDtree``).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values
from towers.allreduce.machinery.packed import assemble
from towers.allreduce.machinery.primitives import pad_split, unsplit
from towers.allreduce.machinery.registry import (
    Algorithm,
    Coefficients,
    Configured,
    register,
    schedule_of,
)
from towers.allreduce.tree import reduce_broadcast, tick_loads, tree_bytes, tree_shape
from towers.guard.arguments import positive_int

__all__ = [
    "DOUBLE_BINARY_TREE",
    "btree_parents",
    "bytes_sent",
    "cost",
    "double_binary_tree",
    "double_trees",
    "summation_depth",
]


def btree_parents(n: int) -> list[int]:
    """NCCL's binary tree rooted at 0, as ``parents[tower]`` (``-1`` for the root).

    Example:
        >>> btree_parents(8)
        [-1, 2, 4, 2, 0, 6, 4, 6]
    """
    parents = [-1] * n
    for rank in range(1, n):
        bit = rank & -rank  # lowest set bit: the rank's level above the leaves
        up = (rank ^ bit) | (bit << 1)
        parents[rank] = up if up < n else rank ^ bit
    return parents


def double_trees(n: int) -> tuple[list[int], list[int]]:
    """Tree A and tree B as parent lists: B is A mirrored (even ``n``) or shifted by one (odd).

    Example:
        >>> double_trees(4)
        ([-1, 2, 0, 2], [1, 3, 1, -1])
    """
    first = btree_parents(n)
    if n % 2 == 0:
        second = [-1 if first[n - 1 - r] == -1 else n - 1 - first[n - 1 - r] for r in range(n)]
    else:
        second = [-1 if first[(r - 1) % n] == -1 else (first[(r - 1) % n] + 1) % n
                  for r in range(n)]
    return first, second


def _double_binary_tree(values: Sequence[tf.Tensor], op: str, chunks: int) -> list[tf.Tensor]:
    devices = check_values(values, op)
    n = len(values)
    split = [pad_split(v, 2 * chunks) for v in values]
    _, shape, size = split[0]
    halves = []
    for h, parents in enumerate(double_trees(n)):
        ids = [h * chunks + k for k in range(chunks)]
        pieces = [[p[i] for i in ids] for p, _, _ in split]
        halves.append(reduce_broadcast(pieces, parents, devices, op, chunk_ids=ids))
    held = [halves[0][i] + halves[1][i] for i in range(n)]
    return assemble(held, devices, lambda tower: unsplit(held[tower], shape, size))


def _build(chunks: int = 1) -> AllReduce:
    c = positive_int("chunks", chunks)

    def double_binary_tree_all_reduce(
        values: Sequence[tf.Tensor], *, op: str = "sum"
    ) -> list[tf.Tensor]:
        return _double_binary_tree(values, op, c)

    return double_binary_tree_all_reduce


def double_binary_tree(chunks: int = 1) -> Configured:
    """Build the double-binary-tree all-reduce; each half is pipelined in ``chunks`` pieces.

    Args:
        chunks: pieces per half (``C``, default 1: each tree moves its half whole).

    Raises:
        ValueError: ``chunks`` < 1 or not an int.

    Example:
        >>> outs = double_binary_tree()([a, b, c, d], op="mean")   # doctest: +SKIP
    """
    return DOUBLE_BINARY_TREE(chunks=chunks)


def bytes_sent(n: int, nbytes: int, itemsize: int, chunks: int = 1) -> list[int]:
    """Exact bytes per tower: ``Σ_trees (1[not root] + children)·C·ceil(size/(2C))·itemsize``.

    Example:
        >>> bytes_sent(4, 16, 4)
        [16, 32, 32, 16]
    """
    c = positive_int("chunks", chunks)
    piece = -(-(nbytes // itemsize) // (2 * c)) * itemsize
    first, second = double_trees(n)
    per_tree = zip(tree_bytes(first, c, piece), tree_bytes(second, c, piece), strict=True)
    return [a + b for a, b in per_tree]


def summation_depth(n: int, chunks: int = 1) -> int:
    """Most additions any result element went through, over both trees (5 for n = 8).

    Example:
        >>> summation_depth(8)
        5
    """
    positive_int("chunks", chunks)
    if n < 1:
        return 0
    return max(tree_shape(parents).adds[parents.index(-1)] for parents in double_trees(n))


def cost(n: int, nbytes: float, *, chunks: int = 1) -> Coefficients:
    """α-β-γ coefficients ``M·(α + S/2C·β) + A·S/2C·γ`` over both trees' schedule."""
    messages, adds = tick_loads(double_trees(n), positive_int("chunks", chunks))
    piece = nbytes / (2 * chunks)
    return messages, messages * piece, adds * piece


DOUBLE_BINARY_TREE = register(
    Algorithm("double_binary_tree", _build, bytes_sent, summation_depth, cost, schedule_of(__doc__))
)
