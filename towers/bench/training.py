"""The training-step table: towers against tf.distribute, as ratios to MirroredStrategy.

The same seeded model and SGD on one fixed batch, tf.distribute in a custom loop; the
ceiling ``towers noop/replicated`` exchanges nothing. Their first losses must agree.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from reference import CentralStorageTrainer, MirroredTrainer
from towers import allreduce
from towers.bench import report
from towers.bench.report import interleave, num, paired_ratio, text
from towers.step import PLACEMENTS, TowerTrainer
from towers.training.models import mlp, mnist_cnn

__all__ = ["BASELINES", "MIRRORED", "MODELS", "build_steps", "config_names", "make_batch",
           "run_model", "section", "table"]

MODELS: dict[str, tuple[Callable[[], keras.Model], tuple[int, ...]]] = {
    "conv-mnist": (lambda: mnist_cnn(0), (28, 28, 1)),
    "mlp": (lambda: mlp(seed=0), (784,)),
}

MIRRORED = "MirroredStrategy"
BASELINES = (MIRRORED, "CentralStorageStrategy")
QUICK_ALGORITHMS = ("naive", "parameter_device", "ring", "tree")  # under --quick
LOSS_TOLERANCE = 1e-4


def make_batch(model: str, batch: int = 256, seed: int = 0) -> tuple[tf.Tensor, tf.Tensor]:
    """A fixed batch of random inputs and labels 0-9 for ``model`` (a :data:`MODELS` key)."""
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *MODELS[model][1]), dtype=np.float32)
    return tf.constant(x), tf.constant(rng.integers(0, 10, size=batch).astype(np.int32))


def _sgd() -> keras.optimizers.Optimizer:  # a fresh one per model
    return keras.optimizers.SGD(0.01)


def strategy_step(trainer: Any, x: tf.Tensor, y: tf.Tensor) -> Callable[[], tf.Tensor]:
    """A custom loop over a :mod:`reference` trainer's strategy, model and optimizer."""
    strategy, model, optimizer = trainer.strategy, trainer.model, trainer.optimizer
    batch = int(x.shape[0])
    inputs = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((x, y)))))

    def replica_step(xs: tf.Tensor, ys: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(
                ys, model(xs, training=True), from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(inputs: Any) -> tf.Tensor:
        per_replica = strategy.run(replica_step, args=inputs)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return lambda: step(inputs)


def _step(name: str, model: str, devices: Sequence[str], x: tf.Tensor,
          y: tf.Tensor) -> Callable[[], tf.Tensor]:
    make_model = MODELS[model][0]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if not name.startswith("towers "):
        reference = MirroredTrainer if name == MIRRORED else CentralStorageTrainer
        return strategy_step(reference(make_model, _sgd, loss, list(devices)), x, y)
    algorithm, placement = name.removeprefix("towers ").rsplit("/", 1)
    towers = TowerTrainer(make_model, _sgd, loss, devices=list(devices),
                          all_reduce=algorithm, variables=placement,
                          check_algorithm=algorithm != "noop")  # the ceiling does not sum
    return lambda: towers.train_step(x, y)


def config_names(algorithms: Sequence[str] | None = None,
                 placements: Sequence[str] = tuple(PLACEMENTS), ceiling: bool = True) -> list[str]:
    """The baselines, ``towers <algorithm>/<placement>`` for each pair, and the ceiling."""
    names = allreduce.ALGORITHMS if algorithms is None else algorithms
    towers = [f"towers {a}/{p}" for a in names for p in placements]
    return [*BASELINES, *towers, *(["towers noop/replicated"] if ceiling else [])]


def build_steps(model: str, devices: Sequence[str], names: Sequence[str], batch: int = 256,
                strict: bool = True) -> tuple[dict[str, Callable[[], tf.Tensor]], dict[str, str]]:
    """Steps of the configurations called ``names`` on :func:`make_batch`, and why the
    others cannot be built (``strict``: ValueError instead)."""
    x, y = make_batch(model, batch)
    steps, errors = {}, {}
    for name in names:
        try:
            steps[name] = _step(name, model, devices, x, y)
        except Exception as err:  # reported as a row
            errors[name] = report.reason(err)
    if strict and errors:
        raise ValueError("; ".join(f"{k}: {v}" for k, v in errors.items()))
    return steps, errors


def _rows(model: str, names: Sequence[str], samples: dict[str, Any],
          losses: dict[str, float], errors: dict[str, str]) -> list[dict[str, Any]]:
    mirrored = samples.get(MIRRORED)
    tf_names = [k for k in samples if not k.startswith("towers ")]
    best_tf = min(tf_names, default=None, key=lambda k: paired_ratio(samples[k], mirrored)
                  if mirrored else samples[k].median)
    rows = []
    for name in names:
        s = samples.get(name)
        algorithm, _, placement = (name.removeprefix("towers ").rpartition("/")
                                   if name.startswith("towers ") else ("", "", ""))
        kind = "ceiling" if algorithm == "noop" else "towers" if algorithm else "tf.distribute"
        row: dict[str, Any] = {
            "model": model, "config": name, "kind": kind, "algorithm": algorithm,
            "placement": placement, "first_loss": losses.get(name),
            **dict.fromkeys(("ms", "min_ms", "cpu_ms", "ratio", "ratio_best_tf")),
            "best_tf": best_tf, "error": errors.get(name, ""),
        }
        if s is not None:
            row.update(ms=s.median * 1e3, min_ms=s.minimum * 1e3, cpu_ms=s.cpu_median * 1e3,
                       ratio=paired_ratio(s, mirrored) if mirrored else None,
                       ratio_best_tf=paired_ratio(s, samples[best_tf]) if best_tf else None)
        rows.append(row)
    return rows


def run_model(model: str, devices: Sequence[str], *, batch: int = 256, rounds: int = 13,
              calls: int = 1, verbose: bool = False, **options: Any) -> list[dict[str, Any]]:
    """Build ``model``'s configurations (``options``: :func:`config_names`'), take their
    first losses, time them interleaved; one row each."""
    names = config_names(**options)
    steps, errors = build_steps(model, devices, names, batch, strict=False)
    losses = {}
    for name, step in steps.items():
        try:
            losses[name] = float(step())
        except Exception as err:  # reported as a row
            errors[name] = report.reason(err)
    runnable = {k: v for k, v in steps.items() if k not in errors}
    samples = interleave(runnable, rounds, calls=calls, warmup=1, verbose=verbose,
                         label=f"training steps: {model}, batch {batch}, {len(devices)} towers")
    rows = _rows(model, names, samples, losses, errors)
    del steps, runnable
    gc.collect()
    return rows


COLUMNS: list[report.Column] = [
    ("model\n", "l", text("model")), ("configuration\n", "l", text("config")),
    ("step\n(ms)", "r", num("ms", ".1f")), ("ratio to\nMirrored", "r", num("ratio", ".2f")),
    ("ratio to\nbest tf", "r", num("ratio_best_tf", ".2f")),
    ("min\n(ms)", "r", num("min_ms", ".1f")), ("cpu\n(ms)", "r", num("cpu_ms", ".1f")),
    ("first\nloss", "r", num("first_loss", ".6f")),
]


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Step times and ratios, one line per model and configuration; errors after."""
    return report.format_table(COLUMNS, [r for r in rows if not r.get("error")]) + "".join(
        f"\n# {r['model']} {r['config']}: not run ({r['error']})" for r in rows if r.get("error"))


def plot(rows: Sequence[dict[str, Any]], path: Any) -> Any:
    """Horizontal bars: step time over MirroredStrategy's, one panel per model."""
    rows = [r for r in rows if r.get("ratio")]
    models = list(dict.fromkeys(r["model"] for r in rows))
    most = max((sum(r["model"] == m for r in rows) for m in models), default=1)
    fig = report.figure(9, 1.8 + 0.3 * most)
    for k, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), k + 1)
        mine = [r for r in rows if r["model"] == model]
        colors = [{"towers": "tab:blue", "ceiling": "tab:olive"}.get(r["kind"], "tab:gray")
                  for r in mine]
        ax.barh([r["config"] for r in mine], [r["ratio"] for r in mine], color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7, labelleft=k == 0)
        ax.set(xlabel="step time / MirroredStrategy", title=model)
    fig.suptitle("training step, ratio to MirroredStrategy")
    return report.save(fig, path)


def section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """``--sections training``: the step table, CSV and plot; False if first losses differ."""
    rows: list[dict[str, Any]] = []
    algorithms = list(QUICK_ALGORITHMS) if args.quick else None
    if args.algorithms is not None:  # the tf.* names are the all-reduce table's
        algorithms = [a for a in args.algorithms if not a.startswith("tf.")]
    for model in args.models or list(MODELS):
        report.heading(f"training step: {model}, batch {args.batch_size}, SGD, "
                       f"{len(devices)} towers")
        rows += run_model(model, devices, algorithms=algorithms, verbose=not args.quiet,
                          rounds=args.step_rounds or (5 if args.quick else 13),
                          batch=args.batch_size, placements=args.placements or PLACEMENTS)
    report.publish(args, results, "training", rows, "\n" + table(rows),
                   lambda out: plot(rows, out / "training_ratio.png"))
    results["training_load"] = os.getloadavg()
    ok = True
    for model in dict.fromkeys(r["model"] for r in rows):
        losses = [r["first_loss"] for r in rows if r["model"] == model and r.get("first_loss")]
        if losses and max(losses) - min(losses) > LOSS_TOLERANCE * max(1.0, abs(losses[0])):
            print(f"WRONG: first-step losses of {model} disagree: {min(losses)}..{max(losses)}")
            ok = False
    return ok
