"""Draw a trace as a PNG: towers as rows, ticks as columns, one arrow per transfer.

:func:`draw` renders a :class:`~towers.trace.Trace` with matplotlib (Agg, so no
display is needed). Arrows are coloured by chunk (dashed: estimated traffic of an
opaque collective); a star marks where a chunk first held every tower's
contribution; the right-hand column shows the chunks each tower holds at the end::

    tick      0          1          2      │    3          4          5
    tower 0  c3 ─▶1     c2 ─▶1     c1 ─▶1  │   c0 ─▶1 ...          holds c0 c1 c2 c3
    tower 1  c0 ─▶2 ...                 ★c1 finished here (tick 2)

Under each tick number is the tick's most common note (``reduce``, ``copy``, …);
``*`` after it: the tick was assigned by order.

Example:
    >>> draw(trace_all_reduce("ring", devices[:4]), "ring.png")   # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type hints only: schedule.py does not import this module
    from towers.trace.schedule import Trace

__all__ = ["draw"]


def _colours(trace: Trace) -> dict[int, Any]:
    import matplotlib

    labels = sorted({r.chunk for r in trace.rows if r.chunk is not None} | set(trace.chunks))
    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {c: cmap(k % cmap.N) for k, c in enumerate(labels)}


def _column_notes(trace: Trace) -> list[str]:
    """Per tick: its most common note, and ``*`` when the tick was assigned by order."""
    out = []
    for tick in range(trace.ticks):
        rows = [r for r in trace.rows if r.tick == tick]
        notes = [r.note for r in rows if r.note]
        star = "*" if any(r.assigned for r in rows) else ""
        out.append(f"{tick}{star}\n{max(set(notes), key=notes.count) if notes else ''}")
    return out


def _draw_arrows(ax: Any, trace: Trace, colours: dict[int, Any]) -> None:
    seen: dict[tuple[int, int, int], int] = {}
    labelled: dict[tuple[int, int], list[int | None]] = {}
    for r in trace.rows:
        k = seen[(r.tick, r.src, r.dst)] = seen.get((r.tick, r.src, r.dst), -1) + 1
        x = r.tick + 0.1 * k - 0.05 * (k > 0)
        colour = colours.get(r.chunk, "0.45") if r.chunk is not None else "0.45"
        ax.annotate(
            "", xy=(x + 0.3, r.dst), xytext=(x - 0.3, r.src),
            arrowprops={
                "arrowstyle": "-|>", "color": colour, "lw": 1.8, "shrinkA": 3, "shrinkB": 3,
                "linestyle": "--" if r.estimated else "-",
                "connectionstyle": f"arc3,rad={0.3 if abs(r.dst - r.src) > 1 else 0.0}",
            },
        )
        here = labelled.setdefault((r.tick, r.src), [])
        if r.chunk not in here:  # one label per chunk leaving a tower in a tick, side by side
            text = f"c{r.chunk}" if r.chunk is not None else ""
            text = f"~{r.nbytes}" if r.estimated else text
            ax.text(r.tick - 0.36 + 0.17 * len(here), r.src - 0.2, text, fontsize=7,
                    color=colour, ha="left")
            here.append(r.chunk)
    for c, (p, tick) in trace.finished.items():
        ax.plot(tick + 0.44, p, marker="*", ms=13, color=colours.get(c, "0.45"), mec="black")


def _draw_ownership(ax: Any, trace: Trace, colours: dict[int, Any], x0: float) -> float:
    """The right-hand column: per place, one square per chunk it holds complete at the end."""
    chunks = trace.chunks
    width = max(1.2, 0.3 * len(chunks))
    ax.text(x0 + width / 2, -0.75, "holds at end\n(★ = finished here)", ha="center", fontsize=8)
    if not trace.holds:
        ax.text(x0 + width / 2, (len(trace.places) - 1) / 2, "not observable\n(opaque)",
                ha="center", va="center", fontsize=8)
        return width
    import matplotlib.patches as patches

    w = width / len(chunks)
    finished_by = {c: p for c, (p, _) in trace.finished.items()}
    for p, held in enumerate(trace.holds):
        for j, c in enumerate(chunks):
            mine = finished_by.get(c) == p
            ax.add_patch(patches.Rectangle(
                (x0 + j * w + 0.03, p - 0.25), w - 0.06, 0.5,
                facecolor=colours.get(c, "0.45") if c in held else "white",
                edgecolor="black" if mine else "0.6", lw=2.2 if mine else 0.8,
            ))
            if mine:
                ax.text(x0 + (j + 0.5) * w, p, "★", ha="center", va="center", fontsize=8)
    return width


def _legend(ax: Any, trace: Trace, colours: dict[int, Any]) -> None:
    from matplotlib.lines import Line2D

    shown = sorted({r.chunk for r in trace.rows if r.chunk is not None})[:12]
    handles = [Line2D([], [], color=colours[c], lw=2, label=f"chunk {c}") for c in shown]
    if any(r.chunk is None for r in trace.rows):
        handles.append(Line2D([], [], color="0.45", lw=2, label="no chunk label"))
    if any(r.estimated for r in trace.rows):
        handles.append(Line2D([], [], color="0.45", lw=2, ls="--", label="estimated"))
    if trace.finished:
        handles.append(Line2D([], [], color="0.6", marker="*", ms=11, mec="black", lw=0,
                              label="chunk complete"))
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                  ncol=min(len(handles), 7), fontsize=8, frameon=False)


def draw(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Draw the trace as a PNG (matplotlib, Agg): towers as rows, ticks as columns.

    Each transfer is an arrow from its source row to its destination row within its
    tick's column, coloured by chunk (dashed: estimated); a star marks where a chunk
    first holds every tower's contribution; the right-hand column shows which chunks
    each tower holds complete at the end (a bold square: finished there).

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks, places, colours = max(trace.ticks, 1), len(trace.places), _colours(trace)
    width = max(1.2, 0.3 * len(trace.chunks))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.25 * ticks + 2.2 + width), 1.0 + 0.7 * places))
    for p in range(places):
        ax.axhspan(p - 0.45, p + 0.45, color="0.96" if p % 2 else "0.91", zorder=0)
    for t in range(ticks + 1):
        ax.axvline(t - 0.5, color="white", lw=2, zorder=0)
    _draw_arrows(ax, trace, colours)
    _draw_ownership(ax, trace, colours, ticks - 0.3)
    ax.set_xlim(-0.5, ticks - 0.2 + width)
    ax.set_ylim(places - 0.5, -1.1)
    ax.set_yticks(range(places), [trace.place_name(p) for p in range(places)])
    ax.set_xticks(range(trace.ticks), _column_notes(trace), fontsize=8)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    verdict = "= NumPy" if trace.ok else "WRONG vs NumPy"
    ax.set_title(
        f"{trace.algorithm}: {trace.towers} towers × {trace.size} {trace.dtype}, op={trace.op}, "
        f"{len(trace.rows)} transfers in {trace.ticks} tick{'' if trace.ticks == 1 else 's'}, "
        f"result {verdict}",
        fontsize=10,
    )
    _legend(ax, trace, colours)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
