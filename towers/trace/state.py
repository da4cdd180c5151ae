"""What every tower holds after every tick: which towers' contributions each chunk carries.

Inputs name themselves: tower ``i`` holds ``j·2ⁿ + 2ⁱ`` at element ``j``, so a sum over a
set ``S`` of towers is ``|S|·j·2ⁿ + mask(S)`` (exact in float32 below 2²⁴)::

    sum from towers {0, 2}: 2·5·16 + 0b0101 = 165  →  j = 5, holds {0, 2}   (n = 4)

A tower's state after tick ``t``: its own contribution plus all it received by ``t``.
Chunks (segments) are the element ranges no send splits. An opaque collective sends
nothing observable: its one tick goes from the inputs to the decoded outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from towers.allreduce.machinery.resolve import label
from towers.trace.schedule import record_formula, resolve, run_trace
from towers.trace.table import Trace

__all__ = ["StateTrace", "Topology", "default_size", "range_label", "runs", "sends_by_tick",
           "topology", "trace_state"]

Held = tuple[frozenset[int], ...]  # per segment: the towers whose contributions it holds
Ranges = tuple[tuple[int, int], ...]  # element ranges [start, stop)


@dataclasses.dataclass(frozen=True)
class StateTrace:
    """A traced all-reduce with every tower's chunk state before and after each tick."""

    trace: Trace
    segments: Ranges  # the element ranges no send splits
    carried: tuple[Ranges, ...]  # per row: the element ranges it carries
    states: tuple[tuple[Held, ...], ...]  # states[k][tower]: after tick k - 1 (k = 0: inputs)
    outputs: tuple[Held, ...]  # per tower: what its output holds, decoded
    observed: bool  # False: an opaque collective (state read from the outputs only)
    alpha: float | None  # the record's cost formula's α coefficient (None: no formula)

    @property
    def towers(self) -> int:
        return self.trace.towers

    @property
    def ticks(self) -> int:
        return len(self.states) - 1

    @property
    def messages(self) -> int:
        """α counted as the cost model does: per tick the busiest port's messages, summed
        (one send and one receive port per tower; chunks to one peer in a tick: one message)."""
        total = 0
        for tick in range(self.trace.ticks):
            ports: dict[tuple[str, int], set[int]] = {}
            for r in self.trace.rows:
                if r.tick == tick and not r.estimated:
                    ports.setdefault(("out", r.src), set()).add(r.dst)
                    ports.setdefault(("in", r.dst), set()).add(r.src)
            total += max((len(peers) for peers in ports.values()), default=0)
        return total

    def __str__(self) -> str:
        alpha = "none" if self.alpha is None else f"{self.alpha:g}"
        done = "every chunk holds all contributions" if self.complete() else "INCOMPLETE"
        if self.states[-1] != self.outputs:
            done += "; the OUTPUTS hold less than the state says"
        seen = "" if self.observed else " (opaque: end state read from the outputs)"
        chunks = f"{len(self.segments)} chunk{'' if len(self.segments) == 1 else 's'}"
        return (f"{self.trace.algorithm}: {self.towers} towers × {self.trace.size} elements in "
                f"{chunks}; {self.ticks} ticks, α = {self.messages} messages "
                f"(cost formula: {alpha}); {done}{seen}")

    def complete(self, k: int = -1) -> bool:
        """True when after state ``k`` every tower's every segment holds all contributions."""
        everyone = frozenset(range(self.towers))
        return all(held == everyone for tower in self.states[k] for held in tower)


def default_size(n: int) -> int:
    """``n`` times the next power of two ≥ ``n``: every registered split divides it."""
    return n * (1 << max(n - 1, 0).bit_length())


def runs(elements: Sequence[int]) -> Ranges:
    """Sorted element indices as maximal ranges ``[start, stop)``."""
    out: list[list[int]] = []
    for j in sorted(elements):
        if out and out[-1][1] == j:
            out[-1][1] = j + 1
        else:
            out.append([j, j + 1])
    return tuple((a, b) for a, b in out)


def range_label(ranges: Ranges) -> str:
    """Element ranges as text: ``0:4,8:12`` (empty: ``-``)."""
    return ",".join(f"{a}:{b}" for a, b in ranges) or "-"


def sends_by_tick(state: StateTrace) -> dict[tuple[int, int, int], Ranges]:
    """``(tick, src, dst)`` -> the element ranges sent, merged (one arrow per pair and tick)."""
    merged: dict[tuple[int, int, int], set[int]] = {}
    for r, carried in zip(state.trace.rows, state.carried):
        if not r.estimated and r.src < state.towers and r.dst < state.towers:
            elements = merged.setdefault((r.tick, r.src, r.dst), set())
            for a, b in carried:
                elements |= set(range(a, b))
    return {key: runs(sorted(elements)) for key, elements in sorted(merged.items())}


def _decode(values: Any, n: int) -> dict[int, frozenset[int]]:
    """Element index -> contributing towers, for every nonzero element (zeros: padding)."""
    flat = np.rint(np.asarray(values, dtype=np.float64).reshape(-1)).astype(np.int64)
    out: dict[int, frozenset[int]] = {}
    for v in flat[flat != 0]:
        mask = int(v) & ((1 << n) - 1)
        count, rest = bin(mask).count("1"), (int(v) - mask) >> n
        if count == 0 or rest % count:
            raise ValueError(f"a sent value {int(v)} is no sum of labelled contributions")
        out[rest // count] = frozenset(i for i in range(n) if mask >> i & 1)
    return out


def _held(per_element: Sequence[frozenset[int]], segments: Ranges) -> Held:
    """Per segment: the contributions every element of it holds."""
    return tuple(frozenset.intersection(*per_element[a:b]) for a, b in segments)


def _states(trace: Trace, masks: list[dict[int, frozenset[int]]], size: int,
            segments: Ranges) -> list[tuple[Held, ...]]:
    n = trace.towers
    now = [[frozenset({p}) for _ in range(size)] for p in range(len(trace.places))]
    out = [tuple(_held(now[p], segments) for p in range(n))]
    for tick in range(trace.ticks):
        for r, mask in zip(trace.rows, masks):
            if r.tick == tick:
                for j, held in mask.items():
                    now[r.dst][j] = now[r.dst][j] | held
        out.append(tuple(_held(now[p], segments) for p in range(n)))
    return out


def trace_state(algorithm: str | Callable[..., Any], devices: Sequence[str], *,
                size: int | None = None) -> StateTrace:
    """Trace ``algorithm`` (op ``sum``, ``size`` elements per tower, default
    :func:`default_size`) and every tower's chunk state per tick (``ValueError``: too many
    towers or elements, or sends that are no sums of contributions)."""
    n = len(devices)
    size = size or default_size(n)
    if n > 24 or size * n << n >= 1 << 24:
        raise ValueError(f"devices: a state trace labels {n} towers × {size} elements exactly "
                         "only while size·n·2ⁿ < 2²⁴ (at most 8 towers at the default size)")
    fn = resolve(algorithm, devices)
    j = np.arange(size, dtype=np.float64) * (1 << n)
    labelled = [(j + (1 << i)).astype(np.float32) for i in range(n)]
    trace, payloads, results = run_trace(fn, devices, labelled, op="sum", name=label(algorithm),
                                payloads=True)
    masks = [{} if p is None or t.estimated else _decode(p, n)
             for t, p in zip(trace.transfers, payloads)]
    carried = [runs(list(m)) for m in masks]
    cuts = sorted({0, size} | {c for ranges in carried for a, b in ranges for c in (a, b)})
    segments = tuple(itertools.pairwise(c for c in cuts if 0 <= c <= size))
    outputs = tuple(_held([d.get(j, frozenset()) for j in range(size)], segments)
                    for d in (_decode(o, n) for o in results))
    observed = any(masks) or not trace.rows
    states = _states(trace, masks, size, segments) if observed else [
        tuple(tuple(frozenset({p}) for _ in segments) for p in range(n)), outputs]
    alpha = record_formula(fn, lambda r: float(r.algorithm.cost(n, size * 4, **r.params)[0]))
    return StateTrace(trace, segments, tuple(carried), tuple(states), outputs, observed, alpha)


Positions = list[tuple[float, float]]
Links = list[tuple[int, int]]


class Topology(NamedTuple):
    """A layout: its kind, a position per tower and the undirected links between towers."""

    kind: str
    positions: Positions
    links: Links


def _circle(n: int) -> Positions:
    return [(math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n)) for i in range(n)]


def _tree(n: int, links: Links, root: int) -> Positions | None:
    if len(links) != n - 1:
        return None
    depth, order = {root: 0}, [root]
    for node in order:  # breadth first from the root
        for peer in sorted({b for a, b in links if a == node} | {a for a, b in links if b == node}):
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


def topology(state: StateTrace) -> Topology:
    """The layout the traced links fit, the first of: ``butterfly`` (n = 2ᵏ ≥ 4, every link
    joins towers differing in one bit), ``ring`` (exactly i ↔ i+1 mod n), ``tree`` (connected,
    n - 1 links, layers from the first tower to hold all), ``torus R×C`` (every link inside a
    row or a column, both used), else ``graph`` (a circle with chords); ``collective`` (no
    links seen: a hub) and ``single`` (one tower)."""
    n = state.towers
    links = sorted({(min(r.src, r.dst), max(r.src, r.dst)) for r in state.trace.rows
                    if not r.estimated and r.src < n and r.dst < n})
    if n == 1:
        return Topology("single", [(0.0, 0.0)], [])
    if not links:
        return Topology("collective", _circle(n), [])
    if n >= 4 and not n & (n - 1) and all(bin(a ^ b).count("1") == 1 for a, b in links):
        return Topology("butterfly", _circle(n), links)  # the picture draws the stages
    if n >= 3 and set(links) == {tuple(sorted((i, (i + 1) % n))) for i in range(n)}:
        return Topology("ring", _circle(n), links)
    everyone = frozenset(range(n))  # a tree's root: the first tower to hold all somewhere
    root = next((p for towers in state.states for p, held in enumerate(towers)
                 if everyone in held), 0)
    tree = _tree(n, links, root)
    if tree:
        return Topology("tree", tree, links)
    grid = _torus(n, links)
    return Topology(*grid, links) if grid else Topology("graph", _circle(n), links)
