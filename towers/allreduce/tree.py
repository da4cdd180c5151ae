"""Binary-tree all-reduce: reduce up to tower 0, then broadcast down, pipelined in pieces.

Towers form a binary heap: tower ``i``'s children are ``2i+1`` and ``2i+2``.
Each value is flattened, zero-padded and cut into ``C`` pieces. A node adds its
children's partials of a piece to its own and passes the result up; tower 0
finishes each piece (``mean`` divides) once and the pieces are copied back down.
n = 7, C = 2 (``pK`` = piece K, ``▲a`` = send up to a, ``▼a,b`` = copy down to a and b)::

    tick        0         1          2           3           4
    tower 0     .         .       p0 ▼1,2     p1 ▼1,2        .
    tower 1     .       p0 ▲0     p1 ▲0       p0 ▼3,4     p1 ▼3,4
    tower 2     .       p0 ▲0     p1 ▲0       p0 ▼5,6     p1 ▼5,6
    tower 3   p0 ▲1     p1 ▲1       .           .           .
    tower 4   p0 ▲1     p1 ▲1       .           .           .
    tower 5   p0 ▲2     p1 ▲2       .           .           .
    tower 6   p0 ▲2     p1 ▲2       .           .           .

Index formula (``h`` = a node's height, its longest path down to a leaf; ``d`` =
its depth; ``D`` = the root's height): a node sends piece ``k`` up at tick
``h + k`` and copies it to its children at tick ``D + d + k``. Each piece moves
one level per tick, so the ticks overlap: while lower levels still reduce piece
``k + 1``, upper levels already broadcast piece ``k`` (tick 3 above: tower 0
copies p1 down as towers 1, 2 copy p0 down; on a link the up and down
directions carry different pieces). In all ``2D + C - 1`` ticks.

Order: node ``i`` forms ``x_i ⊕ p_a ⊕ p_b``, joining the child whose partial has
been through fewer additions first, so the deeper subtree's values pass through
one addition fewer; :func:`tree_shape` holds the order and the depth. That is the
order eager execution runs. Inside a ``tf.function`` Grappler may fuse a node's two
additions into one ``AddN`` and reorder its inputs (see ``towers/allreduce/replay.py``):
then at most two additions per level, a depth of ``2·D``. Towers still agree bitwise.

Cost (n towers, S bytes, D = ⌊log2 n⌋; single-port full-duplex links, the
convention of :mod:`towers.bench.costmodel`): ``2D + C - 1`` ticks. C = 1 is a binary
(not binomial) tree: a node takes its two children's values one after the other,
``4D·(α + S·β) + 2D·S·γ``. Pipelined, a tick costs the busiest port, at most three
pieces of ``S/C`` (one up, two down once reduce and broadcast overlap):
``≲ (2D + C - 1)·3·(α + S/C·β) + (D + C - 1)·2·S/C·γ``. Bytes (exact in
:func:`bytes_sent`): an inner node sends ``3·S``, a leaf ``S``.

References:
    P. Sanders, J. Speck, J. L. Träff, "Two-tree algorithms for full bandwidth
    broadcast, reduction and scan", Parallel Computing 35(12), 2009 (pipelined
    binary trees); R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of
    collective communication operations in MPICH", IJHPCA 19(1), 2005.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values, combine, finish
from towers.allreduce.machinery.packed import assemble
from towers.allreduce.machinery.primitives import pad_split, send, unsplit
from towers.allreduce.machinery.registry import (
    Algorithm,
    Coefficients,
    Configured,
    register,
    schedule_of,
)
from towers.guard.arguments import positive_int

__all__ = [
    "TREE",
    "TreeShape",
    "bytes_sent",
    "heap_parents",
    "reduce_broadcast",
    "summation_depth",
    "tick_loads",
    "tree",
    "tree_bytes",
    "tree_shape",
]


class TreeShape(NamedTuple):
    """A rooted tree over towers, with what the schedule needs."""

    root: int
    children: list[list[int]]  # in combine order: fewer additions first
    depth: list[int]
    height: list[int]
    adds: list[int]  # most additions any value in a node's partial went through


def heap_parents(n: int) -> list[int]:
    """Binary-heap parents: ``parents[i] = (i - 1) // 2``, ``-1`` for the root (tower 0).

    Example:
        >>> heap_parents(5)
        [-1, 0, 0, 1, 1]
    """
    return [(i - 1) // 2 if i else -1 for i in range(n)]


def _depths(parents: Sequence[int]) -> list[int]:
    n = len(parents)
    depth = []
    for i in range(n):
        d, j = 0, i
        while parents[j] != -1:
            j, d = parents[j], d + 1
            if not 0 <= j < n or d > n:
                raise ValueError(f"parents {list(parents)} is not a tree (at tower {i})")
        depth.append(d)
    return depth


def tree_shape(parents: Sequence[int]) -> TreeShape:
    """Check ``parents`` (``-1`` marks the one root) and derive order, depth, height, adds.

    Example:
        >>> tree_shape([-1, 0, 0]).adds[0]
        2
    """
    roots = [i for i, p in enumerate(parents) if p == -1]
    if len(roots) != 1:
        raise ValueError(f"parents must have exactly one root (-1), got {list(parents)}")
    depth = _depths(parents)
    n = len(parents)
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


def _reduce_up(
    pieces: Sequence[Sequence[tf.Tensor]], shape: TreeShape, devices: Sequence[str],
    op: str, ids: Sequence[int],
) -> list[tf.Tensor]:
    """Combine every piece up the tree; returns the root's (unfinished) pieces."""
    partial: list[list[tf.Tensor]] = [list(row) for row in pieces]
    for node in sorted(range(len(devices)), key=lambda i: -shape.depth[i]):
        dst = devices[node]
        for k in range(len(ids)):
            with tf.device(dst):
                acc = pieces[node][k]
                for child in shape.children[node]:
                    moved = send(partial[child][k], dst, tick=shape.height[child] + k,
                                 chunk=ids[k], note="reduce")
                    acc = combine(acc, moved, op)
            partial[node][k] = acc
    return partial[shape.root]


def _broadcast_down(
    finished: Sequence[tf.Tensor], shape: TreeShape, devices: Sequence[str], ids: Sequence[int]
) -> list[list[tf.Tensor]]:
    """Copy the root's finished pieces down the tree, one level per tick."""
    out: list[list[tf.Tensor]] = [[None] * len(ids) for _ in devices]
    out[shape.root] = list(finished)
    top = shape.height[shape.root]
    for node in sorted(range(len(devices)), key=lambda i: shape.depth[i]):
        for child in shape.children[node]:
            for k in range(len(ids)):
                out[child][k] = send(out[node][k], devices[child],
                                     tick=top + shape.depth[node] + k, chunk=ids[k],
                                     note="broadcast")
    return out


def reduce_broadcast(
    pieces: Sequence[Sequence[tf.Tensor]],
    parents: Sequence[int],
    devices: Sequence[str],
    op: str,
    *,
    chunk_ids: Sequence[int] | None = None,
) -> list[list[tf.Tensor]]:
    """Pipelined all-reduce over any tree: reduce each piece to the root, finish, copy down.

    Args:
        pieces: ``pieces[tower][k]``, the same number of equally shaped pieces per
            tower, each on ``devices[tower]``.
        parents: ``parents[tower]``, the parent tower, ``-1`` for the root.
        devices: one device per tower.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        chunk_ids: labels recorded for piece ``k`` (default ``k``).

    Returns:
        ``out[tower][k]``: piece ``k`` reduced and finished once on the root, on
        ``devices[tower]``; every tower's copy is bitwise the same.

    Example:
        >>> out = reduce_broadcast(pieces, heap_parents(n), devices, "sum")   # doctest: +SKIP
    """
    shape = tree_shape(parents)
    if len(pieces) != len(devices) or len(parents) != len(devices):
        raise ValueError(f"{len(pieces)} towers of pieces, {len(parents)} parents, "
                         f"{len(devices)} devices: need one each")
    ids = list(range(len(pieces[0]))) if chunk_ids is None else list(chunk_ids)
    combined = _reduce_up(pieces, shape, devices, op, ids)
    with tf.device(devices[shape.root]):
        finished = [finish(c, op, len(devices)) for c in combined]
    return _broadcast_down(finished, shape, devices, ids)


def _build(chunks: int = 1) -> AllReduce:
    c = positive_int("chunks", chunks)

    def tree_all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        devices = check_values(values, op)
        split = [pad_split(v, c) for v in values]
        _, shape, size = split[0]
        out = reduce_broadcast([p for p, _, _ in split], heap_parents(len(values)), devices, op)
        return assemble(out, devices, lambda tower: unsplit(out[tower], shape, size))

    return tree_all_reduce


def tree(chunks: int = 1) -> Configured:
    """Build the binary-tree all-reduce, pipelined in ``chunks`` pieces.

    Args:
        chunks: pieces per value (``C``); more pieces overlap more ticks.

    Raises:
        ValueError: ``chunks`` < 1 or not an int.

    Example:
        >>> outs = tree(chunks=4)([a, b, c], op="sum")   # doctest: +SKIP
    """
    return TREE(chunks=chunks)


def tree_bytes(parents: Sequence[int], pieces: int, piece_bytes: int) -> list[int]:
    """Bytes each tower sends in :func:`reduce_broadcast`: one piece up, one per child, each."""
    children = [0] * len(parents)
    for p in parents:
        if p != -1:
            children[p] += 1
    return [((p != -1) + children[i]) * pieces * piece_bytes for i, p in enumerate(parents)]


def bytes_sent(n: int, nbytes: int, itemsize: int, chunks: int = 1) -> list[int]:
    """Exact bytes per tower: ``(1[i > 0] + children(i))·C·ceil(size/C)·itemsize``.

    Example:
        >>> bytes_sent(3, 12, 4)
        [24, 12, 12]
    """
    c = positive_int("chunks", chunks)
    piece = -(-(nbytes // itemsize) // c) * itemsize
    return tree_bytes(heap_parents(n), c, piece)


def summation_depth(n: int, chunks: int = 1) -> int:
    """Most additions any result element went through (4 for n = 8; at most 2·⌊log2 n⌋).

    Example:
        >>> summation_depth(8)
        4
    """
    positive_int("chunks", chunks)
    return tree_shape(heap_parents(n)).adds[0] if n > 0 else 0


def _heights_depths(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    depth = [-1] * len(parents)

    def find(i: int) -> int:
        if depth[i] < 0:
            depth[i] = 0 if parents[i] < 0 else find(parents[i]) + 1
        return depth[i]

    height = [0] * len(parents)
    for i in sorted(range(len(parents)), key=find, reverse=True):  # children first
        if parents[i] >= 0:
            height[parents[i]] = max(height[parents[i]], height[i] + 1)
    return height, depth


def tick_loads(trees: Sequence[Sequence[int]], chunks: int) -> tuple[float, float]:
    """``(M, A)``: Σ over ticks of the most messages on one port and pieces added by one tower.

    The schedule of :func:`reduce_broadcast` over ``trees`` run at once (single-port,
    full duplex). Ports are columns ``[0, n)`` (out), ``[n, 2n)`` (in); adds
    ``[2n, 3n)``. Each event lasts ``chunks`` ticks (one piece per tick), so loads only
    change where an event starts or ends: count on those segments, weighted by their length.
    """
    n = len(trees[0])
    starts, cols = [], []
    for parents in trees:
        height, depth = _heights_depths(parents)
        top = max(height)
        for i, p in enumerate(parents):
            if p >= 0:  # up: i → p at tick height[i]; down: p → i at tick top + depth[p]
                starts += [height[i]] * 3 + [top + depth[p]] * 2
                cols += [i, n + p, 2 * n + p, p, n + i]
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


TREE = register(Algorithm("tree", _build, bytes_sent, summation_depth, cost, schedule_of(__doc__)))
