"""What a study writes: the CSV of every step, the curves as a PNG, and a summary table.

The PNG has one panel per x axis, one line per reducer::

    loss ▲                      loss ▲                        loss ▲
         │╲  fp16                    │╲                            │╲
         │ ╲__ ring                  │ ╲__                         │ ╲__
         └────────▶ gradient MB      └────────▶ ms on 8xH100       └────────▶ ms on 1024xH100
                    per tower

The loss is the training loss, averaged over a sliding window (the title says how
many steps) so the curves can be told apart; the CSV keeps every step's own value.

Example:
    >>> write_csv(rows, "study.csv"); plot(rows, "study.png")   # doctest: +SKIP
    >>> print(summary_table(rows))                                # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from towers.bench import report

__all__ = ["plot", "summary", "summary_table", "write_csv"]


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Every row, one per step (columns: see :mod:`towers.study.run`)."""
    return report.write_csv(Path(path), rows)


def _runs(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        runs.setdefault(row["reducer"], []).append(row)
    return runs


def _systems(rows: Sequence[dict[str, Any]]) -> list[str]:
    prefix = "cumulative_predicted_s_"
    return [k[len(prefix):] for k in rows[0] if k.startswith(prefix)] if rows else []


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per reducer: bytes per step, predicted ms per step, final loss and accuracy."""
    out = []
    for label, mine in _runs(rows).items():
        last = mine[-1]
        entry = {"reducer": label, "steps": len(mine),
                 "gradient_bytes_per_step": last["gradient_bytes"],
                 "gradient_bytes_per_tower": last["gradient_bytes_per_tower"],
                 "final_loss": float(np.mean([r["loss"] for r in mine[-5:]])),
                 "test_accuracy": last["test_accuracy"]}
        for system in _systems(rows):
            seconds = last[f"predicted_s_{system}"]
            entry[f"ms_{system}"] = None if seconds == "" else 1e3 * float(seconds)
        out.append(entry)
    return out


def _milliseconds(system: str) -> Callable[[dict[str, Any]], str]:
    def cell(row: dict[str, Any]) -> str:
        value = row[f"ms_{system}"]
        return "-" if value is None else f"{value:.4g}"

    return cell


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`summary` as aligned text (final loss: the mean of the last 5 steps)."""
    columns: list[report.Column] = [
        ("reducer\n", "l", lambda r: r["reducer"]),
        ("gradient bytes\nper tower/step", "r", lambda r: f"{r['gradient_bytes_per_tower']:,}"),
    ]
    for system in _systems(rows):
        columns.append((f"predicted\nms/step {system}", "r", _milliseconds(system)))
    columns += [("final loss\n(last 5 steps)", "r", lambda r: f"{r['final_loss']:.4f}"),
                ("test\naccuracy", "r", lambda r: f"{100 * r['test_accuracy']:.1f}%")]
    return report.format_table(columns, summary(rows))


def _smooth(values: list[float], window: int) -> np.ndarray:
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def plot(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Loss against gradient bytes per tower, and against predicted time on each system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, systems = _runs(rows), _systems(rows)
    steps = max(len(r) for r in runs.values())
    window = max(1, steps // 20)
    axes_x = [("cumulative gradient MB sent per tower", "bytes")] + [
        (f"cumulative predicted communication ms, {s}", s) for s in systems]
    fig, axes = plt.subplots(1, len(axes_x), figsize=(5.2 * len(axes_x), 4.2), squeeze=False)
    for ax, (label, key) in zip(axes[0], axes_x):
        for name, mine in runs.items():
            loss = _smooth([float(r["loss"]) for r in mine], window)
            if key == "bytes":
                xs = np.cumsum([r["gradient_bytes_per_tower"] for r in mine]) / 1e6
            elif mine[0][f"predicted_s_{key}"] == "":
                continue  # no cost formula: nothing to plot
            else:
                xs = 1e3 * np.asarray([float(r[f"cumulative_predicted_s_{key}"]) for r in mine])
            k = list(runs).index(name)  # equal curves (latency-bound runs) stay visible
            ax.plot(xs, loss, label=name, linewidth=2.2 - 0.35 * (k % 4),
                    linestyle=("-", "--", "-.", ":")[k % 4])
        ax.set_xlim(left=0)
        ax.set_xlabel(label)
        ax.set_ylabel(f"training loss ({window}-step mean)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or "loss against communication, same start, same batches")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
