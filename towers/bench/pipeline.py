"""The input-pipeline table: host slicing against the per-device pipeline.

Every configuration trains the same seeded model (``replicated``, ``ring``, SGD) on
the same stream of global batches: a ``tf.data.Dataset`` of ``BATCHES`` distinct
batches of uint8 images (cast and scaled in a ``map``, as an MNIST pipeline does),
repeated. One timed call is one training step *including* fetching its batch:

- ``host slicing``: ``trainer.train_step(*next(batches))``; the batch arrives whole on
  the host (``prefetch``) and the step cuts it (:func:`towers.split.shard_batch`) and
  copies each shard to its tower inside the step;
- ``pipeline multi_device`` / ``pipeline per_device``:
  ``trainer.train_step_shards(next(shards))`` over :func:`towers.split.distribute`; the
  shards are cut in tf.data and already wait on their towers' devices;
- ``fixed batch``: ``train_step`` on one pre-converted batch (no input at all), the floor;
  ``fixed shards``: ``train_step_shards`` on one batch's shards, already on the towers
  (the floor of the pipeline: what its step costs without fetching).

Every configuration's first call sees the same batch and weights, so ``first_loss``
agrees across the table (bitwise: the pipeline's step is host slicing's). Calls are
timed round-robin (:func:`towers.bench.timing.interleave`); ``ratio`` is the median
over rounds of the step time over host slicing's in the same round.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.bench import report
from towers.bench.timing import interleave, load_average, paired_ratio
from towers.bench.training import LEARNING_RATE, MODELS
from towers.split import PIPELINES, Shards, distribute
from towers.step import TowerTrainer

__all__ = ["BATCHES", "HOST", "make_dataset", "pipeline_configs", "pipeline_section",
           "run_pipeline", "wrong_losses"]  # fmt: skip

BATCHES = 8
"""Distinct global batches in the stream (it repeats)."""
HOST = "host slicing"
ALGORITHM, PLACEMENT = "ring", "replicated"


def make_dataset(model: str, batch: int = 256, seed: int = 0) -> tf.data.Dataset:
    """``BATCHES`` random global batches for ``model``, uint8 images scaled in a ``map``."""
    rng = np.random.default_rng(seed)
    shape = MODELS[model][1]
    x = rng.integers(0, 256, size=(BATCHES * batch, *shape), dtype=np.uint8)
    y = rng.integers(0, 10, size=BATCHES * batch).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    return data.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).repeat()


def _trainer(model: str, devices: Sequence[str]) -> TowerTrainer:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return TowerTrainer(MODELS[model][0], lambda: keras.optimizers.SGD(LEARNING_RATE), loss,
                        devices=list(devices), all_reduce=ALGORITHM,
                        variables=PLACEMENT)  # fmt: skip


def _fed_step(trainer: TowerTrainer, shards: Iterator[Shards]) -> tf.Tensor:
    return trainer.train_step_shards(next(shards))


def pipeline_configs(
    model: str, devices: Sequence[str], batch: int = 256
) -> dict[str, Callable[[], tf.Tensor]]:
    """Configuration name -> one training step that fetches its own batch first."""
    data = make_dataset(model, batch)
    steps: dict[str, Callable[[], tf.Tensor]] = {}
    host, batches = _trainer(model, devices), iter(data.prefetch(2))
    steps[HOST] = lambda: host.train_step(*next(batches))
    for pipeline in PIPELINES:
        trainer = _trainer(model, devices)
        shards = iter(distribute(data, trainer.devices, pipeline=pipeline))
        steps[f"pipeline {pipeline}"] = functools.partial(_fed_step, trainer, shards)
    fixed, (x, y) = _trainer(model, devices), next(iter(data))
    steps["fixed batch"] = lambda: fixed.train_step(x, y)
    placed = _trainer(model, devices)
    first = next(iter(distribute(data, placed.devices)))
    steps["fixed shards"] = lambda: placed.train_step_shards(first)
    return steps


def run_pipeline(
    model: str, devices: Sequence[str], *, batch: int = 256, rounds: int = 13, calls: int = 2,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """Build the configurations for ``model``, take their first losses, time them interleaved."""
    steps = pipeline_configs(model, devices, batch)
    losses = {name: float(step()) for name, step in steps.items()}
    samples = interleave(steps, rounds, calls=calls, warmup=1, verbose=verbose,
                         label=f"input pipeline: {model}, batch {batch}, "
                               f"{len(devices)} towers")  # fmt: skip
    return [{"model": model, "config": name, "towers": len(devices), "batch": batch,
             "first_loss": losses[name], "ms": s.median * 1e3, "min_ms": s.minimum * 1e3,
             "cpu_ms": s.cpu_median * 1e3, "ratio": paired_ratio(s, samples[HOST])}
            for name, s in samples.items()]  # fmt: skip


COLUMNS: list[report.Column] = [
    ("model\n", "l", lambda r: r["model"]),
    ("configuration\n", "l", lambda r: r["config"]),
    ("first\nloss", "r", lambda r: f"{r['first_loss']:.6f}"),
    ("step\n(ms)", "r", lambda r: f"{r['ms']:.1f}"),
    ("min\n(ms)", "r", lambda r: f"{r['min_ms']:.1f}"),
    ("cpu\n(ms)", "r", lambda r: f"{r['cpu_ms']:.1f}"),
    ("ratio to\nhost slicing", "r", lambda r: f"{r['ratio']:.3f}"),
]


def pipeline_section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """``towers bench --sections pipeline``: the table, ``pipeline.csv``; False when the
    first losses of one model differ (the pipeline must feed the same batch)."""
    models = args.models or list(MODELS)
    rounds = args.step_rounds or (5 if args.quick else 13)
    towers = devices[: args.towers]
    rows: list[dict[str, Any]] = []
    for model in models:
        load = ", ".join(f"{v:.2f}" for v in load_average())
        print(f"\n== input pipeline: {model}, batch {args.batch_size}, {len(towers)} towers, "
              f"{ALGORITHM}/{PLACEMENT}  (load average {load})", flush=True)  # fmt: skip
        rows += run_pipeline(model, towers, batch=args.batch_size, rounds=rounds,
                             verbose=not args.quiet)  # fmt: skip
    print("# one call = fetch the next global batch + one training step; ratio = median over "
          "rounds of step / host slicing's")
    print(report.format_table(COLUMNS, rows))
    results["pipeline"] = rows
    report.write_csv(args.out / "pipeline.csv", rows)
    wrong = wrong_losses(rows)
    for line in wrong:
        print(f"WRONG: {line}")
    return not wrong


def wrong_losses(rows: list[dict[str, Any]]) -> list[str]:
    """One line per model whose configurations' first losses differ (they must be bitwise
    equal: the same weights, the same first batch, the same step)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        losses = {r["config"]: r["first_loss"] for r in rows if r["model"] == model}
        if len(set(losses.values())) > 1:
            out.append(f"first losses of {model} differ across the pipeline table: {losses}")
    return out
