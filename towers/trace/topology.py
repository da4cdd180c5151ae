"""The links an all-reduce used, and where to draw its towers: ring, tree, butterfly, torus.

:func:`topology` reads the links off a state trace (every pair of towers that exchanged
data) and picks the first layout they fit; nothing is written per algorithm::

    butterfly  n = 2ᵏ ≥ 4, every link joins towers differing in one bit (halving-doubling)
    ring       the links are exactly i ↔ i+1 (mod n): a circle
    tree       connected, n - 1 links: layers from the root (the first tower to hold all)
    torus      rows × columns, every link inside a row or a column, both kinds used: a grid
    graph      anything else: a circle with chords
    collective an opaque collective (no links seen): a hub
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # hints only
    from towers.trace.state import StateTrace

__all__ = ["Topology", "topology"]


Positions = list[tuple[float, float]]
Links = list[tuple[int, int]]


class Topology(NamedTuple):
    """A layout: its kind, a position per tower and the undirected links between towers."""

    kind: str
    positions: Positions
    links: Links


def _circle(n: int) -> Positions:
    return [(math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n)) for i in range(n)]


def _butterfly(n: int, links: Links) -> Positions | None:
    if n < 4 or n & (n - 1) or any(bin(a ^ b).count("1") != 1 for a, b in links):
        return None
    return _circle(n)  # a circle for the viewer; the picture draws the stages


def _ring(n: int, links: Links) -> Positions | None:
    want = {tuple(sorted((i, (i + 1) % n))) for i in range(n)}
    return _circle(n) if n >= 3 and set(links) == want else None


def _tree(n: int, links: Links, root: int) -> Positions | None:
    if len(links) != n - 1:
        return None
    near: dict[int, list[int]] = {i: [] for i in range(n)}
    for a, b in links:
        near[a].append(b)
        near[b].append(a)
    depth, order = {root: 0}, [root]
    for node in order:
        for peer in sorted(near[node]):
            if peer not in depth:
                depth[peer] = depth[node] + 1
                order.append(peer)
    if len(depth) != n:
        return None
    layers: dict[int, list[int]] = {}
    for node in order:
        layers.setdefault(depth[node], []).append(node)
    positions = [(0.0, 0.0)] * n
    for d, nodes in layers.items():
        for k, node in enumerate(nodes):
            positions[node] = ((k + 1) / (len(nodes) + 1) * 2 - 1, 1 - 2 * d / (max(layers) or 1))
    return positions


def _torus(n: int, links: Links) -> tuple[str, Positions] | None:
    for cols in range(2, n // 2 + 1):
        rows = n // cols
        in_row = [a // cols == b // cols for a, b in links]
        in_col = [a % cols == b % cols for a, b in links]
        if (n % cols == 0 and rows >= 2 and all(r or c for r, c in zip(in_row, in_col))
                and any(in_row) and any(c and not r for r, c in zip(in_row, in_col))):
            return f"torus {rows}×{cols}", [(2 * (i % cols) / (cols - 1) - 1,
                                             1 - 2 * (i // cols) / (rows - 1)) for i in range(n)]
    return None


def _first_complete(state: StateTrace) -> int:
    """The first tower to hold every contribution in some segment (a tree's root)."""
    everyone = frozenset(range(state.towers))
    return next((p for towers in state.states for p, held in enumerate(towers)
                 if everyone in held), 0)


def topology(state: StateTrace) -> Topology:
    """The layout the traced links fit: ``kind`` is one of the module docstring's, or
    ``single`` for one tower."""
    n = state.towers
    links = sorted({(min(r.src, r.dst), max(r.src, r.dst)) for r in state.trace.rows
                    if not r.estimated and r.src < n and r.dst < n})
    if n == 1:
        return Topology("single", [(0.0, 0.0)], [])
    if not links:
        return Topology("collective", _circle(n), [])
    for kind, found in (("butterfly", _butterfly(n, links)), ("ring", _ring(n, links)),
                        ("tree", _tree(n, links, _first_complete(state)))):
        if found:
            return Topology(kind, found, links)
    grid = _torus(n, links)
    return Topology(*grid, links) if grid else Topology("graph", _circle(n), links)
