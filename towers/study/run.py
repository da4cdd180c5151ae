"""Train one model with several reducers from the same start; one row per step.

Every run starts from the same weights (the model built once) and sees the same
full batches in the same order (``batches(..., seed=epoch)``; an epoch's short last
batch is left out, so the step is traced once per run), with a
fresh optimizer and a fresh reducer (codec state starts at zero), so the curves
differ only by the reducer::

    spec ─parse─▶ Spec  ─build─▶ reducer ─▶ TowerTrainer(replicated) ─▶ train_step × steps
                                    │                                     │
                                    └─ Counted all-reduce ─▶ step_traffic ◀┘ last_step_stats
                                                              bytes, predicted seconds

A row holds the step's loss, the test accuracy (every ``eval_every`` steps and at
the last), the step's gradient and bookkeeping bytes, the running gradient bytes,
and per system the step's predicted communication seconds and their running sum.

Example:
    >>> rows = run_study(["ring", "fp16", "topk(0.1)", "powersgd(4)"], devices)  # +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.resolve import Spec, parse
from towers.guard.arguments import positive_int
from towers.step import TowerTrainer
from towers.study.cost import SYSTEMS, StepTraffic, step_traffic
from towers.study.specs import build
from towers.training.data import batches, digits
from towers.training.models import digits_cnn

__all__ = ["run_study"]


def _accuracy(trainer: TowerTrainer, x: np.ndarray, y: np.ndarray) -> float:
    logits = trainer.model(x, training=False)
    return float(np.mean(np.argmax(np.asarray(logits), axis=1) == y))


def _row(entry: Spec, step: int, epoch: int, loss: float, traffic: StepTraffic,
         totals: dict[str, float]) -> dict[str, Any]:
    """The CSV row of one step; ``totals`` (running sums) is updated in place."""
    totals["bytes"] += traffic.gradient_bytes
    row: dict[str, Any] = {
        "reducer": entry.text, "step": step, "epoch": epoch, "loss": loss,
        "test_accuracy": "", "gradient_bytes": traffic.gradient_bytes,
        "gradient_bytes_per_tower": traffic.gradient_bytes_per_tower,
        "bookkeeping_bytes": traffic.bookkeeping_bytes,
        "cumulative_gradient_bytes": int(totals["bytes"]),
    }
    for system, seconds in traffic.seconds.items():
        if seconds is not None:
            totals[system] = totals.get(system, 0.0) + seconds
        row[f"predicted_s_{system}"] = "" if seconds is None else seconds
        row[f"cumulative_predicted_s_{system}"] = "" if seconds is None else totals[system]
    return row


def _run_one(entry: Spec, devices: Sequence[str], start: list[np.ndarray], data: tuple,
             options: dict[str, Any]) -> list[dict[str, Any]]:
    """Train with one reducer; the rows of its steps."""
    x, y, x_test, y_test = data
    reducer, counted = build(entry, devices)
    priced = None if ":" in entry.algorithm else entry.algorithm  # a user's: not priced
    trainer = TowerTrainer(
        options["model"], lambda: keras.optimizers.Adam(options["learning_rate"]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=list(devices), all_reduce=reducer, variables="replicated",
    )
    trainer.set_weights(start)
    rows: list[dict[str, Any]] = []
    totals: dict[str, float] = {"bytes": 0.0}
    traffic = None
    for epoch in range(options["epochs"]):
        for xb, yb in batches(x, y, options["batch_size"], seed=epoch):
            if len(xb) < options["batch_size"] or len(rows) == options["steps"]:
                continue  # a short last batch would trace the step again, for nothing
            loss = float(trainer.train_step(xb, yb))
            stats = trainer.last_step_stats
            if stats is not None:  # the bytes of the trace that ran (shapes decide them)
                traffic = step_traffic(stats, counted, priced, devices,
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
    specs: Sequence[str],
    devices: Sequence[str],
    *,
    model: Callable[[], keras.Model] = digits_cnn,
    data: tuple | None = None,
    epochs: int = 1,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    systems: Sequence[str] = tuple(SYSTEMS),
    eval_every: int = 1,
    steps: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Train ``model`` once per reducer spec from the same start; one row per step.

    Args:
        specs: reducer specs (see :mod:`towers.study.specs`), checked before any training.
        devices: the towers.
        model: builds the model (called with no arguments; the first build's weights are
            every run's start).
        data: ``(x, y, x_test, y_test)`` (default: the bundled digits).
        epochs, batch_size, learning_rate: the training (Adam, sparse cross-entropy).
        systems: where to predict the communication time (:data:`SYSTEMS`).
        eval_every: test accuracy every this many steps (and at the last).
        steps: stop each run after this many steps (None: every epoch to its end).
        progress: called with one line per finished run.

    Returns:
        The rows, run after run (see the module docstring for the columns).

    Raises:
        ValueError: a bad spec, system or count (naming it), or fewer than 2 devices,
            before anything trains.
    """
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
