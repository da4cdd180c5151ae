"""Binary-tree all-reduce: reduce up to tower 0, then broadcast down, pipelined in pieces.

Towers form a binary heap (tower ``i``'s children: ``2i+1``, ``2i+2``); each value is cut
into ``C`` zero-padded pieces. A node adds its children's partials of a piece to its own and
passes the result up; tower 0 finishes each piece once and the pieces are copied back down.
n = 7, C = 2 (``pK`` = piece K, ``▲a`` = send up to a, ``▼a,b`` = copy down to a and b)::

    tick        0         1          2           3           4
    tower 0     .         .       p0 ▼1,2     p1 ▼1,2        .
    tower 1     .       p0 ▲0     p1 ▲0       p0 ▼3,4     p1 ▼3,4
    tower 2     .       p0 ▲0     p1 ▲0       p0 ▼5,6     p1 ▼5,6
    tower 3   p0 ▲1     p1 ▲1       .           .           .
    tower 4   p0 ▲1     p1 ▲1       .           .           .
    tower 5   p0 ▲2     p1 ▲2       .           .           .
    tower 6   p0 ▲2     p1 ▲2       .           .           .

Index formula (``h``: a node's height; ``d``: its depth; ``D``: the root's height): a node
sends piece ``k`` up at tick ``h + k`` and copies it down at ``D + d + k``, so reduce and
broadcast overlap (tick 3 above): ``2D + C - 1`` ticks. Order: node ``i`` forms
``(x_i ⊕ p_a) ⊕ p_b``, own value first, the child with fewer additions joining first
(:func:`tree_shape`); a child joining after a taller sibling sends when that one does.

Cost (D = ⌊log2 n⌋, single-port full-duplex links): C = 1, ``4D·(α + S·β) + 2D·S·γ``;
pipelined, a tick costs the busiest port, at most three pieces of ``S/C``:
``≲ (2D + C - 1)·3·(α + S/C·β) + (D + C - 1)·2·S/C·γ``. An inner node sends ``3·S``, a leaf ``S``.

References:
    P. Sanders, J. Speck, J. L. Träff, "Two-tree algorithms for full bandwidth
    broadcast, reduction and scan", Parallel Computing 35(12), 2009 (pipelined
    binary trees); R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of
    collective communication operations in MPICH", IJHPCA 19(1), 2005.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.guard.arguments import positive_int
from towers.schedule.ir import Schedule, Step

__all__ = ["TreeShape", "cost", "heap_parents", "tick_loads", "tree", "tree_schedule",
           "tree_shape", "tree_ticks"]


class TreeShape(NamedTuple):
    """A rooted tree over towers, with what the schedule needs."""

    root: int
    children: list[list[int]]  # in combine order: fewer additions first
    depth: list[int]
    height: list[int]
    adds: list[int]  # most additions any value in a node's partial went through


def heap_parents(n: int) -> list[int]:
    """Binary-heap parents: ``parents[i] = (i - 1) // 2``, ``-1`` for the root (tower 0)."""
    return [(i - 1) // 2 if i else -1 for i in range(n)]


def tree_shape(parents: Sequence[int]) -> TreeShape:
    """Check ``parents`` (``-1`` marks the one root) and derive order, depth, height, adds."""
    roots = [i for i, p in enumerate(parents) if p == -1]
    if len(roots) != 1:
        raise ValueError(f"parents must have exactly one root (-1), got {list(parents)}")
    n, depth = len(parents), []
    for i in range(n):
        d, j = 0, i
        while parents[j] != -1:
            j, d = parents[j], d + 1
            if not 0 <= j < n or d > n:
                raise ValueError(f"parents {list(parents)} is not a tree (at tower {i})")
        depth.append(d)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p != -1:
            children[p].append(i)
    height, adds = [0] * n, [0] * n
    for i in sorted(range(n), key=lambda i: -depth[i]):  # children before their parent
        kids = sorted(children[i], key=lambda c: (adds[c], c))
        children[i] = kids
        m = len(kids)
        height[i] = 1 + max(height[c] for c in kids) if kids else 0
        adds[i] = max([m] + [adds[c] + m - j for j, c in enumerate(kids)])
    return TreeShape(roots[0], children, depth, height, adds)


def _up_ticks(shape: TreeShape) -> list[int]:
    """The tick each node sends piece 0 up: once its children's partials arrived, and not
    before the sibling it is added after (the root's entry: the tick it finishes piece 0)."""
    up = [0] * len(shape.depth)
    for node in sorted(range(len(up)), key=lambda i: -shape.depth[i]):  # children first
        after = 0
        for child in shape.children[node]:
            up[child] = after = max(up[child], after)
        up[node] = max((up[c] + 1 for c in shape.children[node]), default=0)
    return up


def tree_ticks(parents: Sequence[int], chunks: Iterable[int]) -> list[list[Step]]:
    """Pipelined reduce-then-broadcast over any tree: piece ``k`` is chunk ``chunks[k]``.

    A node reduces piece ``k`` into its parent at its up tick + ``k``; the root finishes it
    at tick ``D + k``; a node at depth ``d`` copies it down at ``D + d + k``.
    """
    shape, pieces = tree_shape(parents), list(chunks)
    up = _up_ticks(shape)
    top = up[shape.root]
    ticks: list[list[Step]] = [[] for _ in range(2 * top + len(pieces) - 1 if top else 0)]
    for node, kids in enumerate(shape.children):
        for child in kids:
            for k, chunk in enumerate(pieces):
                ticks[up[child] + k].append(Step(child, node, chunk, "reduce"))
                ticks[top + shape.depth[node] + k].append(Step(node, child, chunk, "copy"))
    return ticks


@functools.lru_cache(maxsize=256)
def tree_schedule(n: int, chunks: int = 1) -> Schedule:
    """The binary-heap tree all-reduce over ``n`` towers, pipelined in ``chunks`` pieces."""
    c = positive_int("chunks", chunks)
    ticks = tree_ticks(heap_parents(positive_int("n", n)), range(c))
    return Schedule("tree", n, c, tuple(tuple(tick) for tick in ticks))


def tick_loads(trees: Sequence[Sequence[int]], chunks: int) -> tuple[float, float]:
    """``(M, A)``: Σ over ticks of the most messages on one port and pieces added by one tower.

    The trees' :func:`tree_ticks` run at once (single-port, full duplex); each event lasts
    ``chunks`` ticks, so loads are counted on the segments where one starts or ends.
    """
    n = len(trees[0])
    starts, cols = [], []
    for parents in trees:
        shape = tree_shape(parents)
        up, depth = _up_ticks(shape), shape.depth
        top = up[shape.root]
        for i, p in enumerate(parents):
            if p >= 0:  # up: i → p at its up tick; down: p → i at tick top + depth[p]
                starts += [up[i]] * 3 + [top + depth[p]] * 2
                cols += [i, n + p, 2 * n + p, p, n + i]
    if not starts:  # one tower: nothing moves
        return 0.0, 0.0
    begin, where = np.array(starts), np.array(cols)
    bounds = np.unique(np.concatenate([begin, begin + chunks]))
    load = np.zeros((len(bounds), 3 * n))
    np.add.at(load, (np.searchsorted(bounds, begin), where), 1)
    np.add.at(load, (np.searchsorted(bounds, begin + chunks), where), -1)
    load, width = np.cumsum(load, axis=0)[:-1], np.diff(bounds)
    return (float(width @ load[:, : 2 * n].max(axis=1)),
            float(width @ load[:, 2 * n :].max(axis=1)))


def cost(n: int, nbytes: float, *, chunks: int = 1) -> Coefficients:
    """α-β-γ coefficients ``M·(α + S/C·β) + A·S/C·γ`` (``M, A`` from :func:`tick_loads`)."""
    messages, adds = tick_loads([heap_parents(n)], positive_int("chunks", chunks))
    piece = nbytes / chunks
    return messages, messages * piece, adds * piece


tree = register_schedule("tree", tree_schedule, cost, __doc__, own_first=True)
