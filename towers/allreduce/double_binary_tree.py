"""Double binary tree all-reduce (NCCL's "tree"): two complementary trees, half the data each.

A tower inner in one tree (which sends three values) is a leaf in the other (one); each
tree reduces-then-broadcasts half of the data. Tree A (NCCL's ``ncclGetBtree``, root 0):
tower ``r > 0`` with lowest set bit ``b`` has parent ``(r ^ b) | 2b``, or ``r ^ b`` when
that is out of range. Tree B is A mirrored (``r -> n-1-r``) when ``n`` is even and A
shifted (``r -> r+1 mod n``, tower 0 inner in both) when it is odd. n = 8::

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

Both trees run at once, each half pipelined as in :mod:`towers.allreduce.tree` (its order;
half ``h``'s piece ``k`` is chunk ``h·C + k``). n = 4, C = 1 (A: 0─2─{1,3}; B: 3─1─{2,0})::

    tick        0                1            2             3
    tower 0   c1 ▲1             .          c0 ▼2            .
    tower 1   c0 ▲2           c1 ▲3          .           c1 ▼0,2
    tower 2   c1 ▲1           c0 ▲0          .           c0 ▼1,3
    tower 3   c0 ▲2             .          c1 ▼1            .

Cost (n towers, S bytes, D = tree height ≈ log2 n): ``2D + C - 1`` ticks; a tower sends at
most ``2S``, like the ring, with ``2D`` latency terms. C = 1: ``4D·(α + S/2·β) + D·S·γ``;
pipelining trades α for β as in the single tree. Summation depth: the taller tree's.

References:
    P. Sanders, J. Speck, J. L. Träff, "Two-tree algorithms for full bandwidth
    broadcast, reduction and scan", Parallel Computing 35(12), 2009. S. Jeaugey,
    "Massively scale your deep learning training with NCCL 2.4", NVIDIA blog, 2019;
    NCCL ``src/graph/trees.cc`` (``ncclGetBtree``, ``ncclGetDtree``).
"""

from __future__ import annotations

import functools

from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.allreduce.tree import tick_loads, tree_ticks
from towers.guard.arguments import positive_int
from towers.schedule.ir import Schedule

__all__ = ["btree_parents", "cost", "double_binary_tree",
           "double_binary_tree_schedule", "double_trees"]


def btree_parents(n: int) -> list[int]:
    """NCCL's binary tree rooted at 0, as ``parents[tower]`` (``-1`` for the root)."""
    parents = [-1] * n
    for rank in range(1, n):
        bit = rank & -rank  # lowest set bit: the rank's level above the leaves
        up = (rank ^ bit) | (bit << 1)
        parents[rank] = up if up < n else rank ^ bit
    return parents


def double_trees(n: int) -> tuple[list[int], list[int]]:
    """Tree A and tree B as parent lists: B is A mirrored (even ``n``) or shifted by one (odd)."""
    first = btree_parents(n)
    if n % 2 == 0:
        second = [-1 if first[n - 1 - r] == -1 else n - 1 - first[n - 1 - r] for r in range(n)]
    else:
        second = [-1 if first[(r - 1) % n] == -1 else (first[(r - 1) % n] + 1) % n
                  for r in range(n)]
    return first, second


@functools.lru_cache(maxsize=256)
def double_binary_tree_schedule(n: int, chunks: int = 1) -> Schedule:
    """Both trees at once over ``n`` towers: half ``h``'s piece ``k`` is chunk ``h·C + k``."""
    c = positive_int("chunks", chunks)
    first, second = (tree_ticks(parents, range(h * c, (h + 1) * c))
                     for h, parents in enumerate(double_trees(positive_int("n", n))))
    # B is A mirrored or shifted: the same shape, so as many ticks
    ticks = tuple(tuple(a + b) for a, b in zip(first, second, strict=True))
    return Schedule("double_binary_tree", n, 2 * c, ticks)


def cost(n: int, nbytes: float, *, chunks: int = 1) -> Coefficients:
    """α-β-γ coefficients ``M·(α + S/2C·β) + A·S/2C·γ`` over both trees' schedule."""
    messages, adds = tick_loads(double_trees(n), positive_int("chunks", chunks))
    piece = nbytes / (2 * chunks)
    return messages, messages * piece, adds * piece


double_binary_tree = register_schedule("double_binary_tree", double_binary_tree_schedule,
                                       cost, __doc__, own_first=True)
