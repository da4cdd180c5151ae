"""Tables for the terminal, CSV and JSON files, and PNG plots (matplotlib, Agg).

The all-reduce table follows nccl-tests' layout (``size count type redop time
algbw busbw #wrong``), one row per algorithm and size; :func:`algbw_pivot` puts
the algorithms side by side.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ALLREDUCE_COLUMNS",
    "algbw_pivot",
    "allreduce_table",
    "costmodel_table",
    "format_table",
    "plot_algbw",
    "plot_ratios",
    "training_table",
    "write_csv",
    "write_json",
]

Column = tuple[str, str, Callable[[dict[str, Any]], str]]


def _num(key: str, fmt: str, scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value * scale if scale != 1.0 else value, fmt)

    return get


def _text(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: str(row.get(key) or "")


ALLREDUCE_COLUMNS: list[Column] = [
    ("size\n(B)", "r", _num("size", "d")),
    ("count\n(elements)", "r", _num("count", "d")),
    ("type\n", "r", _text("type")),
    ("redop\n", "r", _text("redop")),
    ("algorithm\n", "l", _text("algorithm")),
    ("time\n(us)", "r", _num("time_us", ".1f")),
    ("algbw\n(GB/s)", "r", _num("algbw", ".3f")),
    ("busbw\n(GB/s)", "r", _num("busbw", ".3f")),
    ("#wrong\n", "r", _num("wrong", "d")),
    ("min\n(us)", "r", _num("min_us", ".1f")),
    ("cpu\n(us)", "r", _num("cpu_us", ".1f")),
]


def format_table(
    columns: Sequence[Column], rows: Sequence[dict[str, Any]], prefix: str = ""
) -> str:
    """Aligned text: two header lines (title, unit) from ``columns``, then one line per row."""
    heads = [[*c[0].split("\n"), ""] for c in columns]
    cells = [[get(row) for _, _, get in columns] for row in rows]
    widths = [max([len(h[0]), len(h[1])] + [len(r[i]) for r in cells])
              for i, h in enumerate(heads)]

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(w) if c[1] == "l" else v.rjust(w)
                 for v, w, c in zip(values, widths, columns)]
        return (prefix + "  ".join(parts)).rstrip()

    head = [line([h[0] for h in heads]), line([h[1] for h in heads])]
    return "\n".join([*head, *(line(r) for r in cells)])


def allreduce_table(rows: Sequence[dict[str, Any]]) -> str:
    """The nccl-tests style table of all-reduce rows (calibration rows left out); errors after."""
    shown = [r for r in rows if r.get("kind") != "calibration" and not r.get("error")]
    text = format_table(ALLREDUCE_COLUMNS, shown)
    failed = {r["algorithm"]: r["error"] for r in rows if r.get("error")}
    return text + "".join(f"\n# {k}: not run ({v})" for k, v in failed.items())


def algbw_pivot(rows: Sequence[dict[str, Any]]) -> str:
    """algbw (GB/s) with sizes down and algorithms across."""
    shown = [r for r in rows if r.get("kind") != "calibration" and r.get("algbw")]
    names = list(dict.fromkeys(r["algorithm"] for r in shown))
    sizes = sorted({r["size"] for r in shown})
    value = {(r["size"], r["algorithm"]): r["algbw"] for r in shown}
    columns: list[Column] = [("size\n(B)", "r", _num("size", "d"))]
    columns += [(f"{n}\n", "r", _num(n, ".3f")) for n in names]
    table = [{"size": s, **{n: value.get((s, n)) for n in names}} for s in sizes]
    return format_table(columns, table)


TRAINING_COLUMNS: list[Column] = [
    ("model\n", "l", _text("model")),
    ("configuration\n", "l", _text("config")),
    ("step\n(ms)", "r", _num("ms", ".1f")),
    ("ratio to\nMirrored", "r", _num("ratio", ".2f")),
    ("ratio to\nbest tf", "r", _num("ratio_best_tf", ".2f")),
    ("min\n(ms)", "r", _num("min_ms", ".1f")),
    ("cpu\n(ms)", "r", _num("cpu_ms", ".1f")),
    ("first\nloss", "r", _num("first_loss", ".6f")),
]


def training_table(rows: Sequence[dict[str, Any]]) -> str:
    """Step times and ratios, one line per model and configuration; errors after."""
    text = format_table(TRAINING_COLUMNS, [r for r in rows if not r.get("error")])
    return text + "".join(f"\n# {r['model']} {r['config']}: not run ({r['error']})"
                          for r in rows if r.get("error"))


def _pct(key: str) -> Callable[[dict[str, Any]], str]:
    return _num(key, ".1f", 100)


COSTMODEL_COLUMNS: list[Column] = [
    ("algorithm\n", "l", _text("algorithm")),
    ("formula\n", "l", _text("formula")),
    ("alpha\n(us)", "r", _num("alpha", ".1f", 1e6)),
    ("1/(2beta+gamma)\n(GB/s)", "r",
     lambda r: f"{1 / r['per_byte'] / 1e9:.2f}" if r["per_byte"] else "inf"),
    ("fit all sizes\n|err| med %", "r", _pct("fit_median_error")),
    ("\nmax %", "r", _pct("fit_max_error")),
    ("held-out sizes\n|err| med %", "r", _pct("held_out_median_error")),
    ("\nmax %", "r", _pct("held_out_max_error")),
]


def costmodel_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`towers.bench.sections.fit_measured`'s rows: the fitted constants and errors."""
    return format_table(COSTMODEL_COLUMNS, rows)


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


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot_algbw(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """algbw against message size, one line per algorithm (log x), saved as PNG."""
    fig = _figure(8, 5)
    ax = fig.add_subplot()
    shown = [r for r in rows if r.get("kind") != "calibration" and r.get("algbw")]
    for name in dict.fromkeys(r["algorithm"] for r in shown):
        mine = sorted((r["size"], r["algbw"]) for r in shown if r["algorithm"] == name)
        dashed = "--" if name.startswith("tf.") else "-"
        ax.plot(*zip(*mine), dashed, marker="o", markersize=3, label=name)
    ax.set(xscale="log", xlabel="bytes per tower", ylabel="algbw (GB/s)",
           title=title or "all-reduce algorithm bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_ratios(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Horizontal bars: step time over MirroredStrategy's, one panel per model."""
    models = list(dict.fromkeys(r["model"] for r in rows if r.get("ratio")))
    most = max((sum(1 for r in rows if r["model"] == m and r.get("ratio")) for m in models),
               default=1)
    fig = _figure(9, 1.8 + 0.3 * most)
    for k, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), k + 1)
        mine = [r for r in rows if r["model"] == model and r.get("ratio")]
        colors = ["tab:gray" if r["kind"] in ("baseline", "tf.distribute") else
                  "tab:olive" if r["kind"] == "ceiling" else "tab:blue" for r in mine]
        ax.barh([r["config"] for r in mine], [r["ratio"] for r in mine], color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7, labelleft=k == 0)
        ax.set(xlabel="step time / MirroredStrategy", title=model)
    fig.suptitle(title or "training step, ratio to MirroredStrategy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path
