"""The two pictures of a trace, as PNGs.

:func:`draw`: towers as rows, ticks as columns, an arrow per transfer coloured by chunk
(dashed: estimated), a star where a chunk first held every contribution. :func:`draw_state`:
the links, then per state every tower's chunks as stacks of ``n`` squares (square ``i``
coloured when it holds tower ``i``'s contribution), the tick's sends between the columns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Rectangle

from towers.trace.state import StateTrace, Topology, range_label, sends_by_tick, topology
from towers.trace.table import Trace

__all__ = ["draw", "draw_state", "pyplot", "save_png"]

_GAP = 0.9  # the state picture's arrow lane between two state columns (a column is 1 wide)
_GREY = "0.45"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _palette(n: int) -> list[Any]:
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _arrow(ax: Any, start: tuple[float, int], end: tuple[float, int], colour: Any,
           lw: float, dashed: bool = False) -> None:
    far = abs(end[1] - start[1]) > 1  # arc past the rows in between
    ax.annotate("", xy=end, xytext=start, arrowprops={
        "arrowstyle": "-|>", "color": colour, "lw": lw, "shrinkA": 2, "shrinkB": 2,
        "linestyle": "--" if dashed else "-", "connectionstyle": f"arc3,rad={0.3 * far}"})


def _frame(ax: Any, rows: list[str], columns: list[tuple[float, str]], fontsize: int) -> None:
    """Row names on the left, column headers on top, no spines."""
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks([x for x, _ in columns], [text for _, text in columns], fontsize=fontsize)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def save_png(fig: Any, path: str | os.PathLike[str], dpi: int) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def _draw_arrows(ax: Any, trace: Trace, colours: dict[int, Any]) -> None:
    seen: dict[tuple[int, int, int], int] = {}
    labelled: dict[tuple[int, int], list[int | None]] = {}
    for r in trace.rows:
        k = seen[(r.tick, r.src, r.dst)] = seen.get((r.tick, r.src, r.dst), -1) + 1
        x = r.tick + 0.1 * k - 0.05 * (k > 0)
        colour = colours.get(r.chunk, _GREY) if r.chunk is not None else _GREY
        _arrow(ax, (x - 0.3, r.src), (x + 0.3, r.dst), colour, 1.8, r.estimated)
        here = labelled.setdefault((r.tick, r.src), [])
        if r.chunk not in here:  # one label per chunk leaving a tower in a tick, side by side
            text = f"~{r.nbytes}" if r.estimated else "" if r.chunk is None else f"c{r.chunk}"
            ax.text(r.tick - 0.36 + 0.17 * len(here), r.src - 0.2, text, fontsize=7,
                    color=colour, ha="left")
            here.append(r.chunk)
    for c, (p, tick) in trace.finished.items():
        ax.plot(tick + 0.44, p, marker="*", ms=13, color=colours.get(c, _GREY), mec="black")


def _draw_ownership(ax: Any, trace: Trace, colours: dict[int, Any], x0: float,
                    width: float) -> None:
    """The right-hand column: per place, one square per chunk it holds complete at the end."""
    ax.text(x0 + width / 2, -0.75, "holds at end\n(★ = finished here)", ha="center", fontsize=8)
    if not trace.holds:
        ax.text(x0 + width / 2, (len(trace.places) - 1) / 2, "not observable\n(opaque)",
                ha="center", va="center", fontsize=8)
        return
    w = width / len(trace.chunks)
    finished_by = {c: p for c, (p, _) in trace.finished.items()}
    for p, held in enumerate(trace.holds):
        for j, c in enumerate(trace.chunks):
            mine = finished_by.get(c) == p
            ax.add_patch(Rectangle(
                (x0 + j * w + 0.03, p - 0.25), w - 0.06, 0.5,
                facecolor=colours.get(c, _GREY) if c in held else "white",
                edgecolor="black" if mine else "0.6", lw=2.2 if mine else 0.8))
            if mine:
                ax.text(x0 + (j + 0.5) * w, p, "★", ha="center", va="center", fontsize=8)


def _legend(ax: Any, trace: Trace, colours: dict[int, Any]) -> None:
    shown = sorted({r.chunk for r in trace.rows if r.chunk is not None})[:12]
    handles = [Line2D([], [], color=colours[c], lw=2, label=f"chunk {c}") for c in shown]
    if any(r.chunk is None for r in trace.rows):
        handles.append(Line2D([], [], color=_GREY, lw=2, label="no chunk label"))
    if any(r.estimated for r in trace.rows):
        handles.append(Line2D([], [], color=_GREY, lw=2, ls="--", label="estimated"))
    if trace.finished:
        handles.append(Line2D([], [], color="0.6", marker="*", ms=11, mec="black", lw=0,
                              label="chunk complete"))
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                  ncol=min(len(handles), 7), fontsize=8, frameon=False)


def draw(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Draw the tick picture of ``trace`` as a PNG; returns ``path`` (under each tick its most
    common note; ``*``: assigned by order)."""
    labels = sorted({r.chunk for r in trace.rows if r.chunk is not None} | set(trace.chunks))
    colours = dict(zip(labels, _palette(len(labels))))
    ticks, places = max(trace.ticks, 1), len(trace.places)
    width = max(1.2, 0.3 * len(trace.chunks))
    fig, ax = pyplot().subplots(figsize=(max(6.0, 1.25 * ticks + 2.2 + width), 1.0 + 0.7 * places))
    for p in range(places):
        ax.axhspan(p - 0.45, p + 0.45, color="0.96" if p % 2 else "0.91", zorder=0)
    for t in range(ticks + 1):
        ax.axvline(t - 0.5, color="white", lw=2, zorder=0)
    _draw_arrows(ax, trace, colours)
    _draw_ownership(ax, trace, colours, ticks - 0.3, width)
    ax.set_xlim(-0.5, ticks - 0.2 + width)
    ax.set_ylim(places - 0.5, -1.1)
    stars = ["*" if any(r.assigned for r in trace.rows if r.tick == t) else ""
             for t in range(trace.ticks)]
    _frame(ax, [trace.place_name(p) for p in range(places)],
           [(t, f"{t}{stars[t]}\n{trace.note(t)}") for t in range(trace.ticks)], 8)
    verdict = "= NumPy" if trace.ok else "WRONG vs NumPy"
    ax.set_title(f"{trace.algorithm}: {trace.towers} towers × {trace.size} {trace.dtype}, "
                 f"op={trace.op}, {len(trace.rows)} transfers in {trace.ticks} "
                 f"tick{'' if trace.ticks == 1 else 's'}, result {verdict}", fontsize=10)
    _legend(ax, trace, colours)
    return save_png(fig, path, 110)


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
    (xa, ya), (xb, yb) = positions[a], positions[b]
    length2 = (xb - xa) ** 2 + (yb - ya) ** 2 or 1.0
    through = False
    for i, (x, y) in enumerate(positions):
        u = ((x - xa) * (xb - xa) + (y - ya) * (yb - ya)) / length2
        near = (x - xa - u * (xb - xa)) ** 2 + (y - ya - u * (yb - ya)) ** 2 < 1e-4
        through |= i not in (a, b) and 0 < u < 1 and near
    ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="-", color="0.55", lw=1.2,
                                 connectionstyle=f"arc3,rad={0.35 * through}", zorder=1))


def _draw_butterfly(ax: Any, n: int, links: list[tuple[int, int]], colours: list[Any]) -> None:
    """Stages left to right, one per bit: tower i meets tower i xor 2ᵏ at stage k."""
    bits = n.bit_length() - 1
    ys = [1 - 2 * i / (n - 1) for i in range(n)]
    for k in range(bits):
        x0, x1 = -1 + 2 * k / bits, -1 + 2 * (k + 1) / bits
        for i in range(n):
            ax.plot([x0, x1], [ys[i], ys[i]], color="0.8", lw=0.8, zorder=1)
            j = i ^ (1 << k)
            if (min(i, j), max(i, j)) in links:
                ax.plot([x0, x1], [ys[i], ys[j]], color=_GREY, lw=1.0, zorder=1)
    for k in range(bits + 1):
        for i in range(n):
            x = -1 + 2 * k / bits
            ax.plot(x, ys[i], "o", ms=9, color=colours[i], mec="black", zorder=2)
            if k == 0:
                ax.text(x - 0.15, ys[i], str(i), ha="right", va="center", fontsize=7)


def draw_state(state: StateTrace, path: str | os.PathLike[str], *, dpi: int = 100) -> Path:
    """Draw the state picture of ``state`` as a PNG (see the module docstring); returns ``path``."""
    n, columns = state.towers, len(state.states)
    colours = _palette(n)
    span = columns * (1 + _GAP) - _GAP
    fig, (left, right) = pyplot().subplots(
        1, 2, figsize=(3.0 + 1.1 * span, 1.6 + 0.55 * n),
        gridspec_kw={"width_ratios": [2.6, 1.1 * span]})
    _draw_topology(left, topology(state), colours)
    palette, blank = np.array(colours)[:, None, :], np.array([0.93, 0.93, 0.93, 1.0])
    for k, towers in enumerate(state.states):  # before the limits: imshow resets them
        for p, held in enumerate(towers):  # a column per chunk, row i: holds tower i's part
            mask = np.array([[i in h for h in held] for i in range(n)])[..., None]
            x = k * (1 + _GAP)
            right.imshow(np.where(mask, palette, blank), interpolation="nearest", aspect="auto",
                         extent=(x + 0.05, x + 0.95, p + 0.38, p - 0.38), zorder=1)
    lanes: dict[tuple[int, int], int] = {}
    for (tick, src, dst), ranges in sends_by_tick(state).items():
        k = lanes[(tick, src)] = lanes.get((tick, src), -1) + 1
        x = (tick + 1) * (1 + _GAP) - _GAP + 0.12 + 0.12 * k
        _arrow(right, (x, src), (x + 0.3, dst), colours[src], 1.2)
        right.text(x - 0.05, src - 0.42 + 0.1 * k, range_label(ranges), fontsize=5,
                   color=colours[src])
    right.set_xlim(-0.1, span + 0.1)
    right.set_ylim(n - 0.5, -0.6)
    headers = [(0.5, "inputs")] + [((t + 1) * (1 + _GAP) + 0.5, f"after tick {t}\n"
                                    f"{state.trace.note(t)}"[:40]) for t in range(state.ticks)]
    _frame(right, [f"tower {p}" for p in range(n)], headers, 7)
    fig.suptitle(str(state), fontsize=9)
    return save_png(fig, path, dpi)
