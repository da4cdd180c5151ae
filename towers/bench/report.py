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

from towers.bench.costmodel.fitting import SPLITS

__all__ = [
    "ALLREDUCE_COLUMNS",
    "algbw_pivot",
    "allreduce_table",
    "costmodel_tables",
    "format_table",
    "plot_algbw",
    "plot_graph_cost",
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


HELD_OUT = SPLITS
"""The held-out splits of :mod:`towers.bench.costcheck`, in column order."""


def _held_out_error(how: str) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        if row.get(f"{how}_train") is None:
            return "-"
        return "train" if row[f"{how}_train"] else f"{row[f'{how}_error'] * 100:+.1f}"

    return get


def _verdicts(row: dict[str, Any]) -> str:
    keys = ("ok", *(f"{how}_ok" for how in HELD_OUT))
    return "/".join("-" if row.get(k) is None else "yes" if row[k] else "NO" for k in keys)


COSTMODEL_COLUMNS: list[Column] = [
    ("algorithm\n", "l", _text("algorithm")),
    ("size\n(B)", "r", _num("nbytes", ".0f")),
    ("measured\n(us)", "r", _num("measured", ".1f", 1e6)),
    ("fit all\n(us)", "r", _num("predicted", ".1f", 1e6)),
    ("fit all\nerr %", "r", _num("rel_error", "+.1f", 100)),
    *((f"{how}\nerr %", "r", _held_out_error(how)) for how in HELD_OUT),
]
"""Per contender and size: the in-sample fit's error, then each held-out fit's ("train": it saw
the row, so its error there is no prediction)."""


def _costmodel_summary_columns(tolerance: float) -> list[Column]:
    return [
        ("algorithm\n", "l", _text("algorithm")),
        ("formula\n", "l", _text("formula")),
        ("alpha\n(us)", "r", _num("alpha", ".1f", 1e6)),
        ("1/(2beta+gamma)\n(GB/s)", "r",
         lambda r: f"{1 / r['per_byte'] / 1e9:.2f}" if r["per_byte"] else "inf"),
        *(col for how, key in (("fit all", ""), *((h, f"{h}_") for h in HELD_OUT)) for col in (
            (f"{how}\n|err| med %", "r", _num(f"{key}median_abs_error", ".1f", 100)),
            ("\nmax %", "r", _num(f"{key}max_abs_error", ".1f", 100)))),
        (f"within {tolerance:.0%}\nall/int/ext", "r", _verdicts),
    ]


def _sizes(sizes: Sequence[float]) -> str:
    return ", ".join(f"{s:.0f}" for s in sizes)


def costmodel_tables(
    details: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]],
    splits: dict[str, tuple[list[float], list[float]]], tolerance: float,
) -> str:
    """:func:`towers.bench.costcheck.check_cost_model`'s rows and summary, and the splits.

    ``splits``: :func:`towers.bench.costcheck.split_sizes`, named in the text so the
    reader knows which rows each held-out fit saw.
    """
    lines = ["fit all: alpha, beta, gamma fitted to every size, compared on the same rows",
             "  (in-sample: how well the formula's shape follows the rows, not a prediction)"]
    lines += [f"{how}: fitted on {_sizes(train)} B only; predicts {_sizes(test)} B"
              if len(train) >= 2 and test else f"{how}: too few sizes to hold any out"
              for how, (train, test) in splits.items()]
    return "\n".join([*lines, "", format_table(COSTMODEL_COLUMNS, details), "",
                      format_table(_costmodel_summary_columns(tolerance), summary)])


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
        ax.axvline(0.8, color="tab:red", linewidth=0.8, linestyle="--")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7, labelleft=k == 0)
        ax.set(xlabel="step time / MirroredStrategy", title=model)
    fig.suptitle(title or "training step, ratio to MirroredStrategy (red: 0.80 target)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_graph_cost(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Graph ops and trace seconds against towers × buckets, one line per algorithm (log-log),
    with a dotted slope-1 guide: a line parallel to it grows linearly."""
    fig = _figure(11, 4.5)
    shown = [r for r in rows if r.get("ops") and r.get("trace_s")]
    for k, (key, label) in enumerate((("ops", "graph ops"), ("trace_s", "trace seconds"))):
        ax = fig.add_subplot(1, 2, k + 1)
        for name in dict.fromkeys(r["algorithm"] for r in shown):
            mine = sorted((r["towers"] * r["buckets"], r[key]) for r in shown
                          if r["algorithm"] == name)
            ax.plot(*zip(*mine), marker="o", markersize=3, label=name)
        if shown:
            x0 = min(r["towers"] * r["buckets"] for r in shown)
            x1 = max(r["towers"] * r["buckets"] for r in shown)
            y0 = min(r[key] for r in shown)
            ax.plot([x0, x1], [y0, y0 * x1 / x0], "k:", linewidth=1, label="linear")
        ax.set(xscale="log", yscale="log", xlabel="towers x buckets", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title or "graph cost of one step (one trace per point)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path
