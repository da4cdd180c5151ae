"""What every section shares: interleaved timing (every configuration once per round, so
all see the same load drift), text tables, CSV/JSON files, PNG figures.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import keras
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from towers.guard.arguments import positive_int

__all__ = ["Column", "Samples", "figure", "format_table", "heading", "interleave", "num",
           "paired_ratio", "publish", "reason", "save", "text", "write_csv", "write_json"]


@dataclasses.dataclass
class Samples:
    """Per-call seconds of one configuration: ``wall[r]`` and ``cpu[r]`` for round ``r``."""

    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def minimum(self) -> float:
        return min(self.wall)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def interleave(
    fns: Mapping[str, Callable[[], Any]], rounds: int, *,
    calls: int | Mapping[str, int] = 1, warmup: int = 2, verbose: bool = False,
    label: str = "", seed: int = 0,
) -> dict[str, Samples]:
    """Time every function ``rounds`` times, in shuffled order, after ``warmup`` untimed
    calls each; ``calls`` (one number or one per name) are averaged into one sample."""
    names = list(fns)
    positive_int("rounds", rounds)
    per_name = {n: positive_int(f"calls[{n!r}]", calls if isinstance(calls, int)
                                else calls.get(n, 1)) for n in names}
    for name in names:
        for _ in range(warmup):
            fns[name]()
    out = {name: Samples() for name in names}
    if verbose and label:
        print(label, flush=True)
    bar = keras.utils.Progbar(rounds, stateful_metrics=["load"], verbose=int(verbose))
    order = random.Random(seed)
    for r in range(rounds):
        for name in order.sample(names, len(names)):
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(per_name[name]):
                fns[name]()
            out[name].wall.append((time.perf_counter() - wall) / per_name[name])
            out[name].cpu.append((time.process_time() - cpu) / per_name[name])
        bar.update(r + 1, [("load", os.getloadavg()[0])])
    return out


def paired_ratio(samples: Samples, reference: Samples) -> float:
    """Median over rounds of ``samples.wall[r] / reference.wall[r]`` (drift cancels per round)."""
    return statistics.median(a / b for a, b in zip(samples.wall, reference.wall))


Column = tuple[str, str, Callable[[dict[str, Any]], str]]
"""``(title\\nunit, "l" or "r" alignment, row -> cell)``."""


def num(key: str, fmt: str, scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
    """A cell: ``row[key] * scale`` formatted by ``fmt``, or ``-`` when missing or NaN."""
    def get(row: dict[str, Any]) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value * scale if scale != 1.0 else value, fmt)

    return get


def text(key: str) -> Callable[[dict[str, Any]], str]:
    """A cell: ``row[key]`` as text (empty when missing)."""
    return lambda row: str(row.get(key) or "")


def format_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    """Aligned text: two header lines (title, unit) from ``columns``, then one line per row."""
    heads = [[*c[0].split("\n"), ""] for c in columns]
    cells = [[get(row) for _, _, get in columns] for row in rows]
    widths = [max([len(h[0]), len(h[1])] + [len(r[i]) for r in cells])
              for i, h in enumerate(heads)]

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(w) if c[1] == "l" else v.rjust(w)
                 for v, w, c in zip(values, widths, columns)]
        return "  ".join(parts).rstrip()

    head = [line([h[0] for h in heads]), line([h[1] for h in heads])]
    return "\n".join([*head, *(line(r) for r in cells)])


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN/inf as null, numpy scalars as numbers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(data), indent=2) + "\n")
    return path


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write dict rows as CSV; the columns are the union of the keys, in first-seen order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(_plain(v)) if isinstance(v, (dict, list)) else v
                             for k, v in row.items()})
    return path


def figure(width: float, height: float) -> Figure:
    """A matplotlib figure drawn off screen (no pyplot state)."""
    return FigureCanvasAgg(Figure(figsize=(width, height))).figure


def save(fig: Figure, path: Path) -> Path:
    """Lay ``fig`` out and write it as a PNG at ``path`` (folders made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return path


def heading(title: str) -> None:
    """A section's title line, with the load average its numbers were taken under."""
    print(f"\n== {title}  (load average {os.getloadavg()[0]:.2f})", flush=True)


def reason(err: Exception) -> str:
    """Why a row was not run: the error's type and first line."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:160]


def publish(args: Any, results: dict, name: str, rows: list[dict[str, Any]], table: str,
            plot: Callable[[Path], Any] | None = None) -> None:
    """Print ``table``; ``rows`` to ``results[name]`` and ``name.csv``; ``plot(args.out)``."""
    print(table, flush=True)
    results[name] = rows
    write_csv(args.out / f"{name}.csv", rows)
    if plot is not None and not args.no_plots:
        plot(args.out)
