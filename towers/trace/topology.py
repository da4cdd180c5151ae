"""The links an all-reduce used, and where to draw its towers: ring, tree, butterfly, torus.

:func:`topology` reads the links off a traced schedule (every pair of towers that
exchanged data) and picks the layout the links fit, first match wins::

    butterfly  n = 2ᵏ ≥ 4, every link joins towers differing in one bit
               (halving-doubling): positions on a circle (a hypercube); the
               picture draws the stages, one column per bit
    ring       the links are exactly i ↔ i+1 (mod n): a circle
    tree       connected, n - 1 links: layers from the root (the first tower
               to hold every contribution)
    torus      rows × columns with every link inside a row or a column, both
               kinds used: a grid
    graph      anything else: a circle with chords
    collective an opaque collective (no links seen): a hub

Nothing is written per algorithm: the same links always give the same layout.

Example:
    >>> topo = topology(state)            # doctest: +SKIP
    >>> topo.kind, topo.positions[0]
    ('ring', (0.0, 1.0))
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # hints only
    from towers.trace.state import StateTrace

__all__ = ["Topology", "topology"]


class Topology(NamedTuple):
    """A layout: its kind, a position per tower and the undirected links between towers."""

    kind: str
    positions: list[tuple[float, float]]
    links: list[tuple[int, int]]


class _Shape(NamedTuple):
    n: int
    links: list[tuple[int, int]]


def _links(state: StateTrace) -> list[tuple[int, int]]:
    n = state.towers
    pairs = {tuple(sorted((r.src, r.dst))) for r in state.trace.rows
             if not r.estimated and r.src < n and r.dst < n}
    return sorted((a, b) for a, b in pairs)


def _circle(n: int) -> list[tuple[float, float]]:
    return [(math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n)) for i in range(n)]


def _butterfly(s: _Shape) -> list[tuple[float, float]] | None:
    n, bits = s.n, s.n.bit_length() - 1
    if n < 4 or n & (n - 1) or any(bin(a ^ b).count("1") != 1 for a, b in s.links):
        return None
    return _circle(n) if bits else None  # a circle for viewers; pictures draw the stages


def _ring(s: _Shape) -> list[tuple[float, float]] | None:
    want = {tuple(sorted((i, (i + 1) % s.n))) for i in range(s.n)}
    return _circle(s.n) if s.n >= 3 and set(s.links) == want else None


def _tree(s: _Shape, root: int) -> list[tuple[float, float]] | None:
    if len(s.links) != s.n - 1 or s.n < 2:
        return None
    near: dict[int, list[int]] = {i: [] for i in range(s.n)}
    for a, b in s.links:
        near[a].append(b)
        near[b].append(a)
    depth, order = {root: 0}, [root]
    for node in order:
        for peer in sorted(near[node]):
            if peer not in depth:
                depth[peer] = depth[node] + 1
                order.append(peer)
    if len(depth) != s.n:
        return None
    layers: dict[int, list[int]] = {}
    for node in order:
        layers.setdefault(depth[node], []).append(node)
    positions = [(0.0, 0.0)] * s.n
    deepest = max(layers) or 1
    for d, nodes in layers.items():
        for k, node in enumerate(nodes):
            positions[node] = ((k + 1) / (len(nodes) + 1) * 2 - 1, 1 - 2 * d / deepest)
    return positions


def _torus(s: _Shape) -> tuple[int, list[tuple[float, float]]] | None:
    for cols in range(2, s.n // 2 + 1):
        if s.n % cols:
            continue
        rows = s.n // cols
        in_row = [a // cols == b // cols for a, b in s.links]
        in_col = [a % cols == b % cols for a, b in s.links]
        if rows >= 2 and all(r or c for r, c in zip(in_row, in_col)) and any(in_row) and any(
            c and not r for r, c in zip(in_row, in_col)
        ):
            return cols, [(2 * (i % cols) / max(cols - 1, 1) - 1, 1 - 2 * (i // cols) / (rows - 1))
                          for i in range(s.n)]
    return None


def _first_complete(state: StateTrace) -> int:
    """The first tower to hold every contribution in some segment (a tree's root)."""
    everyone = frozenset(range(state.towers))
    for towers in state.states:
        for p, held in enumerate(towers):
            if everyone in held:
                return p
    return 0


def topology(state: StateTrace) -> Topology:
    """The layout the traced links fit (see the module docstring).

    Returns:
        A :class:`Topology` with ``kind`` one of ``butterfly``, ``ring``, ``tree``,
        ``torus``, ``graph``, ``collective`` (or ``single`` for one tower).
    """
    n, links = state.towers, _links(state)
    if n == 1:
        return Topology("single", [(0.0, 0.0)], [])
    if not links:
        return Topology("collective", _circle(n), [])
    shape = _Shape(n, links)
    found = _butterfly(shape)
    if found:
        return Topology("butterfly", found, links)
    found = _ring(shape)
    if found:
        return Topology("ring", found, links)
    found = _tree(shape, _first_complete(state))
    if found:
        return Topology("tree", found, links)
    grid = _torus(shape)
    if grid:
        return Topology(f"torus {n // grid[0]}×{grid[0]}", grid[1], links)
    return Topology("graph", _circle(n), links)
