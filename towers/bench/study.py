"""``towers study``: compare reducers and codecs by loss against bytes and predicted time.

Every run starts from the same weights and full batches with a fresh optimizer and reducer;
gradient bytes are measured, the time predicted on :data:`~towers.bench.costmodel.SYSTEMS`
at their GPU count N: the all-reduce calls by ``predict_on``, other sends (top-k's gathers)
by the single-port model grown from n-1 to N-1 peers (docs/codecs.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.compressed import compressed
from towers.allreduce.machinery.primitives import StepStats, Transfer, record, traffic_kind
from towers.allreduce.machinery.resolve import Spec, get, is_reducer, parse
from towers.bench import costmodel, report
from towers.bench.costmodel import SYSTEMS, predict_on
from towers.guard.arguments import positive_int
from towers.step import TowerTrainer
from towers.training.data import batches, digits
from towers.training.models import digits_cnn

__all__ = ["Counted", "build", "plot", "run_study", "summary", "summary_table", "write_csv"]


class Counted:
    """An all-reduce that notes each call's payload (bytes per tower) and transfers."""

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm
        self.calls: list[tuple[int, tuple[Transfer, ...]]] = []

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        with record() as inner:
            out = list(self.algorithm(values, op=op))
        payload = int(values[0].shape.num_elements() or 0) * values[0].dtype.size
        self.calls.append((payload, tuple(inner.transfers)))
        return out


def build(spec: Spec, devices: Sequence[str] = ()) -> tuple[Any, Counted | None]:
    """A fresh reducer for ``TowerTrainer(all_reduce=...)`` and its counted all-reduce
    (None for a user's ``GradientReducer``, which the study cannot see into)."""
    fn = get(spec.algorithm, argument="reducer", devices=devices or None)
    if is_reducer(fn):
        return fn, None
    counted = Counted(fn)
    codec = spec.codec
    return (counted if codec is None else compressed(counted, codec, decode="everywhere")), counted


def _other_seconds(transfers: Sequence[Transfer], n: int, system: str) -> float:
    """Single-port time of ``transfers`` at the busiest port, grown from n-1 to N-1 peers."""
    if n < 2 or not transfers:
        return 0.0
    link, big = SYSTEMS[system]["link"], SYSTEMS[system]["n"]
    load: dict[tuple[str, str], list[int]] = {}
    for t in transfers:  # a port sends one message at a time, and receives one
        for port in ((t.src, "send"), (t.dst, "receive")):
            entry = load.setdefault(port, [0, 0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + (t.nbytes or 0)
    busiest = max(count * link.alpha + nbytes * link.beta for count, nbytes in load.values())
    return busiest * (big - 1) / (n - 1)


def step_traffic(stats: StepStats, counted: Counted | None, algorithm: str | None,
                 devices: Sequence[str], systems: Sequence[str]) -> dict[str, Any]:
    """The last traced step's gradient bytes and its predicted seconds per system."""
    seen = {id(t) for t in stats.transfers}
    calls = [c for c in (counted.calls if counted else []) if c[1] and id(c[1][0]) in seen]
    inside = {id(t) for _, transfers in calls for t in transfers}
    others = [t for t in stats.transfers
              if traffic_kind(t.note) == "gradients" and id(t) not in inside]
    seconds: dict[str, float | None] = dict.fromkeys(systems)
    if counted is not None and algorithm is not None and (
            not calls or algorithm in costmodel.formulas()):
        for s in systems:
            seconds[s] = sum(predict_on(s, algorithm, payload) for payload, _ in calls) + (
                _other_seconds(others, len(devices), s))
    per_tower = stats.gradient_bytes_per_tower
    return {"gradient_bytes": stats.gradient_bytes,
            "gradient_bytes_per_tower": max((per_tower.get(d, 0) for d in devices), default=0),
            "bookkeeping_bytes": stats.bookkeeping_bytes, "seconds": seconds}


def _row(entry: Spec, step: int, epoch: int, loss: float, traffic: dict[str, Any],
         totals: dict[str, float]) -> dict[str, Any]:
    """One step's row: loss, bytes, per system the predicted seconds and their running sum."""
    totals["bytes"] += traffic["gradient_bytes"]
    row: dict[str, Any] = {
        "reducer": entry.text, "step": step, "epoch": epoch, "loss": loss, "test_accuracy": "",
        **{k: traffic[k] for k in ("gradient_bytes", "gradient_bytes_per_tower",
                                   "bookkeeping_bytes")},
        "cumulative_gradient_bytes": int(totals["bytes"]),
    }
    for system, seconds in traffic["seconds"].items():
        if seconds is not None:
            totals[system] = totals.get(system, 0.0) + seconds
        row[f"predicted_s_{system}"] = "" if seconds is None else seconds
        row[f"cumulative_predicted_s_{system}"] = "" if seconds is None else totals[system]
    return row


def _accuracy(trainer: TowerTrainer, x: np.ndarray, y: np.ndarray) -> float:
    logits = trainer.model(x, training=False)
    return float(np.mean(np.argmax(np.asarray(logits), axis=1) == y))


def _run_one(entry: Spec, devices: Sequence[str], start: list[np.ndarray], data: tuple,
             options: dict[str, Any]) -> list[dict[str, Any]]:
    x, y, x_test, y_test = data
    reducer, counted = build(entry, devices)
    trainer = TowerTrainer(
        options["model"], lambda: keras.optimizers.Adam(options["learning_rate"]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=list(devices), all_reduce=reducer, variables="replicated")
    trainer.set_weights(start)
    priced = None if ":" in entry.algorithm else entry.algorithm  # a user's: not priced
    rows: list[dict[str, Any]] = []
    totals, traffic = {"bytes": 0.0}, None
    for epoch in range(options["epochs"]):
        for xb, yb in batches(x, y, options["batch_size"], seed=epoch):
            if len(xb) < options["batch_size"] or len(rows) == options["steps"]:
                continue  # a short last batch would trace the step again, for nothing
            loss = float(trainer.train_step(xb, yb))
            if trainer.last_step_stats is not None:  # the bytes of the trace that ran
                traffic = step_traffic(trainer.last_step_stats, counted, priced, devices,
                                       options["systems"])
            assert traffic is not None
            rows.append(_row(entry, len(rows), epoch, loss, traffic, totals))
            if (len(rows) - 1) % options["eval_every"] == 0:
                rows[-1]["test_accuracy"] = _accuracy(trainer, x_test, y_test)
    if not rows:
        raise ValueError(f"batch_size: {options['batch_size']} is more than the "
                         f"{len(x)} training examples: no full batch to train on")
    rows[-1]["test_accuracy"] = _accuracy(trainer, x_test, y_test)
    return rows


def run_study(
    specs: Sequence[str], devices: Sequence[str], *, model: Callable[[], keras.Model] = digits_cnn,
    data: tuple | None = None, epochs: int = 1, batch_size: int = 64,
    learning_rate: float = 3e-3, systems: Sequence[str] = tuple(SYSTEMS), eval_every: int = 1,
    steps: int | None = None, progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Train ``model`` once per reducer spec (``ring``, ``topk(0.1)``, ``powersgd(4)@tree``,
    ``module:NAME``) from the same start on ``data`` (default: the digits); one row per step,
    its time predicted on ``systems``; ``progress`` gets one line per finished run."""
    entries = [parse(s) for s in specs]
    if not entries:
        raise ValueError("specs: name at least one reducer")
    if len(devices) < 2:
        raise ValueError(f"devices: a study compares communication; give at least 2 towers, "
                         f"got {len(devices)}")
    for system in systems:
        if system not in SYSTEMS:
            raise ValueError(f"systems: unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    options = {"model": model, "epochs": positive_int("epochs", epochs),
               "batch_size": positive_int("batch_size", batch_size),
               "learning_rate": learning_rate, "systems": tuple(systems),
               "eval_every": positive_int("eval_every", eval_every),
               "steps": None if steps is None else positive_int("steps", steps)}
    data = data if data is not None else digits()
    start = model().get_weights()
    rows: list[dict[str, Any]] = []
    for entry in entries:
        mine = _run_one(entry, devices, start, data, options)
        rows += mine
        if progress is not None:
            progress(f"{entry.text}: {len(mine)} steps, final loss {mine[-1]['loss']:.4f}, "
                     f"test accuracy {mine[-1]['test_accuracy']:.3f}")
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Every row, one per step."""
    return report.write_csv(Path(path), rows)


def _runs(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    names = dict.fromkeys(row["reducer"] for row in rows)
    return {name: [row for row in rows if row["reducer"] == name] for name in names}


def _systems(rows: Sequence[dict[str, Any]]) -> list[str]:
    prefix = "cumulative_predicted_s_"
    return [k[len(prefix):] for k in rows[0] if k.startswith(prefix)] if rows else []


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per reducer: bytes per step, predicted ms per step, final loss and accuracy."""
    return [{"reducer": label, "steps": len(mine),
             "gradient_bytes_per_step": mine[-1]["gradient_bytes"],
             "gradient_bytes_per_tower": mine[-1]["gradient_bytes_per_tower"],
             "final_loss": float(np.mean([r["loss"] for r in mine[-5:]])),
             "test_accuracy": mine[-1]["test_accuracy"],
             **{f"ms_{s}": None if mine[-1][f"predicted_s_{s}"] == "" else
                1e3 * float(mine[-1][f"predicted_s_{s}"]) for s in _systems(rows)}}
            for label, mine in _runs(rows).items()]


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`summary` as aligned text (final loss: the mean of the last 5 steps)."""
    columns: list[report.Column] = [
        ("reducer\n", "l", report.text("reducer")),
        ("gradient bytes\nper tower/step", "r", report.num("gradient_bytes_per_tower", ",")),
    ]
    columns += [(f"predicted\nms/step {s}", "r", report.num(f"ms_{s}", ".4g"))
                for s in _systems(rows)]
    columns += [("final loss\n(last 5 steps)", "r", report.num("final_loss", ".4f")),
                ("test\naccuracy", "r", report.num("test_accuracy", ".1%"))]
    return report.format_table(columns, summary(rows))


def plot(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Loss (a sliding mean) against cumulative bytes per tower and predicted time, per panel."""
    runs, systems = _runs(rows), _systems(rows)
    window = max(1, max(len(r) for r in runs.values()) // 20)
    axes_x = [("cumulative gradient MB sent per tower", "bytes")] + [
        (f"cumulative predicted communication ms, {s}", s) for s in systems]
    fig = report.figure(5.2 * len(axes_x), 4.2)
    for i, (label, key) in enumerate(axes_x):
        ax = fig.add_subplot(1, len(axes_x), i + 1)
        for k, (name, mine) in enumerate(runs.items()):
            losses = [float(r["loss"]) for r in mine]
            padded = np.concatenate([np.full(window - 1, losses[0]), losses])
            loss = np.convolve(padded, np.ones(window) / window, mode="valid")
            if key == "bytes":
                xs = np.cumsum([r["gradient_bytes_per_tower"] for r in mine]) / 1e6
            elif mine[0][f"predicted_s_{key}"] == "":
                continue  # no cost formula: nothing to plot
            else:
                xs = 1e3 * np.asarray([float(r[f"cumulative_predicted_s_{key}"]) for r in mine])
            ax.plot(xs, loss, label=name, linewidth=2.2 - 0.35 * (k % 4),  # equal curves
                    linestyle=("-", "--", "-.", ":")[k % 4])               # stay visible
        ax.set_xlim(left=0)
        ax.set(xlabel=label, ylabel=f"training loss ({window}-step mean)")
        ax.grid(True, which="both", alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.suptitle(title or "loss against communication, same start, same batches")
    return report.save(fig, Path(path))
