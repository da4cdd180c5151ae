"""Draw a state trace as a PNG: the topology, and per tick the sends and every tower's state.

:func:`draw_state` renders a :class:`~towers.trace.state.StateTrace` with matplotlib
(Agg). On the left the links the algorithm used, laid out by
:func:`~towers.trace.topology.topology` (ring, tree, butterfly, torus, …). On the
right one column per state (the inputs, then after each tick), one row per tower;
each cell shows the tower's chunks side by side, and each chunk as a stack of ``n``
small squares, square ``i`` coloured in tower ``i``'s colour when the chunk holds
tower ``i``'s contribution. Between two columns, one arrow per send of that tick,
labelled with the element range it carries::

               inputs    │ tick 0 │ after 0  │ tick 1 │ after 1
    tower 0   ▣□□□ …     │  ──▶1  │ ▣▣□□ …   │        │ …
              (chunk c = a column of n squares; filled square i: holds tower i's part)

The title gives the ticks, the α messages counted on the trace beside the cost
formula's, and whether every chunk holds every contribution at the end.

Example:
    >>> draw_state(trace_state("halving_doubling", devices[:8]), "hd.png")   # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from towers.trace.state import StateTrace, runs
from towers.trace.topology import Topology, topology

__all__ = ["draw_state", "range_label", "sends_by_tick"]

_GAP = 0.9  # width of the arrow lane between two state columns (a column is 1 wide)


def range_label(ranges: tuple[tuple[int, int], ...]) -> str:
    """Element ranges as text: ``0:4,8:12`` (empty: ``-``)."""
    return ",".join(f"{a}:{b}" for a, b in ranges) or "-"


def _tower_colours(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _draw_topology(ax: Any, topo: Topology, colours: list[Any]) -> None:
    n = len(topo.positions)
    if topo.kind == "butterfly":
        _draw_butterfly(ax, n, topo.links, colours)
    else:
        for a, b in topo.links:
            _draw_link(ax, topo.positions, a, b)
        if topo.kind == "collective":
            ax.plot(0, 0, "s", ms=22, color="0.8", zorder=1)
            ax.text(0, 0, "opaque", ha="center", va="center", fontsize=7)
            for x, y in topo.positions:
                ax.plot([0, x], [0, y], color="0.75", lw=1, ls="--", zorder=1)
        for i, (x, y) in enumerate(topo.positions):
            ax.plot(x, y, "o", ms=15, color=colours[i], mec="black", zorder=2)
            ax.text(x, y, str(i), ha="center", va="center", fontsize=8, color="white", zorder=3)
    ax.set_title(f"links: {topo.kind}", fontsize=9)
    ax.set_aspect("equal", adjustable="datalim")
    ax.axis("off")


def _draw_link(ax: Any, positions: list[tuple[float, float]], a: int, b: int) -> None:
    """A straight line, or an arc where the line would run through another tower (wrap-around)."""
    from matplotlib.patches import FancyArrowPatch

    (xa, ya), (xb, yb) = positions[a], positions[b]
    length2 = (xb - xa) ** 2 + (yb - ya) ** 2 or 1.0
    through = False
    for i, (x, y) in enumerate(positions):
        u = ((x - xa) * (xb - xa) + (y - ya) * (yb - ya)) / length2
        near = (x - xa - u * (xb - xa)) ** 2 + (y - ya - u * (yb - ya)) ** 2 < 1e-4
        through |= i not in (a, b) and 0 < u < 1 and near
    ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="-", color="0.55", lw=1.2,
                                 connectionstyle=f"arc3,rad={0.35 if through else 0.0}",
                                 zorder=1))


def _draw_butterfly(ax: Any, n: int, links: list[tuple[int, int]], colours: list[Any]) -> None:
    """Stages left to right, one per bit: tower i meets tower i xor 2ᵏ at stage k."""
    bits = n.bit_length() - 1
    ys = [1 - 2 * i / (n - 1) for i in range(n)]
    used = set(links)
    for k in range(bits):
        x0, x1 = -1 + 2 * k / bits, -1 + 2 * (k + 1) / bits
        for i in range(n):
            ax.plot([x0, x1], [ys[i], ys[i]], color="0.8", lw=0.8, zorder=1)
            j = i ^ (1 << k)
            if tuple(sorted((i, j))) in used:
                ax.plot([x0, x1], [ys[i], ys[j]], color="0.45", lw=1.0, zorder=1)
    for k in range(bits + 1):
        for i in range(n):
            x = -1 + 2 * k / bits
            ax.plot(x, ys[i], "o", ms=9, color=colours[i], mec="black", zorder=2)
            if k == 0:
                ax.text(x - 0.15, ys[i], str(i), ha="right", va="center", fontsize=7)


def _draw_cell(ax: Any, x: float, p: int, held: Any, n: int, colours: list[Any]) -> None:
    """One tower's state: a column per chunk, row i filled when it holds tower i's part."""
    import numpy as np

    pixels = np.full((n, len(held), 4), 0.93)
    pixels[..., 3] = 1.0
    for s, towers in enumerate(held):
        for i in towers:
            pixels[i, s] = colours[i]
    ax.imshow(pixels, extent=(x + 0.05, x + 0.95, p + 0.38, p - 0.38), interpolation="nearest",
              aspect="auto", zorder=1)
    edges = [x + 0.05 + 0.9 * s / len(held) for s in range(1, len(held))]
    ax.vlines(edges, p - 0.38, p + 0.38, colors="white", lw=1.0, zorder=2)


def sends_by_tick(state: StateTrace) -> dict[tuple[int, int, int], tuple[tuple[int, int], ...]]:
    """``(tick, src, dst)`` -> the element ranges sent, merged (one arrow per pair and tick)."""
    merged: dict[tuple[int, int, int], set[int]] = {}
    for r, carried in zip(state.trace.rows, state.carried):
        if not r.estimated and r.src < state.towers and r.dst < state.towers:
            elements = merged.setdefault((r.tick, r.src, r.dst), set())
            for a, b in carried:
                elements |= set(range(a, b))
    return {key: runs(sorted(elements)) for key, elements in sorted(merged.items())}


def _draw_sends(ax: Any, state: StateTrace, colours: list[Any]) -> None:
    lanes: dict[tuple[int, int], int] = {}
    for (tick, src, dst), ranges in sends_by_tick(state).items():
        k = lanes[(tick, src)] = lanes.get((tick, src), -1) + 1
        x = (tick + 1) * (1 + _GAP) - _GAP + 0.12 + 0.12 * k
        ax.annotate("", xy=(x + 0.3, dst), xytext=(x, src), arrowprops={
            "arrowstyle": "-|>", "color": colours[src], "lw": 1.2, "shrinkA": 2, "shrinkB": 2,
            "connectionstyle": f"arc3,rad={0.25 if abs(dst - src) > 1 else 0.0}"})
        ax.text(x - 0.05, src - 0.42 + 0.1 * k, range_label(ranges), fontsize=5,
                color=colours[src])


def _headers(state: StateTrace) -> list[tuple[float, str]]:
    out = [(0.5, "inputs")]
    for t in range(state.ticks):
        notes = [r.note for r in state.trace.rows if r.tick == t and r.note]
        note = max(set(notes), key=notes.count) if notes else ""
        out.append(((t + 1) * (1 + _GAP) + 0.5, f"after tick {t}\n{note}"[:40]))
    return out


def _title(state: StateTrace) -> str:
    size = state.trace.size
    alpha = "none" if state.alpha is None else f"{state.alpha:g}"
    done = "every chunk holds all contributions" if state.complete() else "INCOMPLETE"
    if state.states[-1] != state.outputs:
        done += "; the OUTPUTS hold less than the state says"
    seen = "" if state.observed else " (opaque: end state read from the outputs)"
    chunks = f"{len(state.segments)} chunk{'' if len(state.segments) == 1 else 's'}"
    return (f"{state.trace.algorithm}: {state.towers} towers × {size} elements in {chunks}; "
            f"{state.ticks} ticks, α = {state.messages} messages "
            f"(cost formula: {alpha}); {done}{seen}")


def _frame(ax: Any, state: StateTrace, span: float) -> None:
    """Limits, tower names on the left, a header per column on top, no spines."""
    n = state.towers
    ax.set_xlim(-0.1, span + 0.1)
    ax.set_ylim(n - 0.5, -0.6)
    ax.set_yticks(range(n), [f"tower {p}" for p in range(n)], fontsize=8)
    positions, labels = zip(*_headers(state))
    ax.set_xticks(positions, labels, fontsize=7)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def draw_state(state: StateTrace, path: str | os.PathLike[str], *, dpi: int = 100) -> Path:
    """Draw ``state`` as a PNG (see the module docstring).

    Args:
        state: from :func:`~towers.trace.state.trace_state`.
        path: where to write the PNG.
        dpi: resolution.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, columns = state.towers, len(state.states)
    colours = _tower_colours(n)
    span = columns * (1 + _GAP) - _GAP
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(3.0 + 1.1 * span, 1.6 + 0.55 * n),
        gridspec_kw={"width_ratios": [2.6, 1.1 * span]},
    )
    _draw_topology(left, topology(state), colours)
    for k, towers in enumerate(state.states):  # after imshow: it resets the limits
        for p, held in enumerate(towers):
            _draw_cell(right, k * (1 + _GAP), p, held, n, colours)
    _draw_sends(right, state, colours)
    _frame(right, state, span)
    fig.suptitle(_title(state), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)
