"""XLA for each tower's forward/backward, timed against tf.distribute with the same XLA.

::

    config                              forward/backward     reduce + apply
    towers <algo>/<placement>           graph                as written
    towers <algo>/<placement> +XLA      one XLA cluster/tower as written
    MirroredStrategy [+XLA]             [XLA] per replica    tf.distribute's
    CentralStorageStrategy [+XLA]       [XLA] per replica    tf.distribute's

tf.distribute compiles a replica function with XLA only where its collectives have
XLA kernels (GPUs); on CPU devices the part both can compile is the replica's forward
and backward, so the ``+XLA`` baselines wrap exactly that in ``tf.function(jit_compile=True)``
and leave ``apply_gradients`` (and its all-reduce) to the strategy — the same cut as
``TowerTrainer(jit_compile=True)``. Rows are timed in interleaved rounds; ``ratio`` is
the paired median against MirroredStrategy without XLA. :func:`xla_difference` measures
the equivalence bound docs/xla.md states.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.bench.timing import interleave, paired_ratio
from towers.bench.training import MODELS, _per_example, _sgd, make_batch, strategy_step
from towers.step import TowerTrainer

__all__ = ["strategy_xla_step", "xla_difference", "xla_rows", "xla_section", "xla_table"]

MIRRORED = "MirroredStrategy"


def strategy_xla_step(trainer: Any, x: tf.Tensor, y: tf.Tensor) -> Callable[[], tf.Tensor]:
    """A reference trainer's custom loop with the replica's forward/backward under XLA."""
    strategy, model, optimizer = trainer.strategy, trainer.model, trainer.optimizer
    batch = int(x.shape[0])
    inputs = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((x, y)))))

    @tf.function(jit_compile=True)
    def gradients(xs: tf.Tensor, ys: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            per_example = _per_example(ys, model(xs, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        return loss, tape.gradient(loss, model.trainable_variables)

    def replica_step(xs: tf.Tensor, ys: tf.Tensor) -> tf.Tensor:
        loss, grads = gradients(xs, ys)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(inputs: Any) -> tf.Tensor:
        per_replica = strategy.run(replica_step, args=inputs)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return lambda: step(inputs)


def _towers(model: str, devices: Sequence[str], algorithm: str, placement: str,
            jit: bool) -> TowerTrainer:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return TowerTrainer(MODELS[model][0], _sgd, loss, devices=list(devices),
                        all_reduce=algorithm, variables=placement, jit_compile=jit)


def _towers_step(model: str, devices: Sequence[str], algorithm: str, placement: str,
                 jit: bool, x: tf.Tensor, y: tf.Tensor) -> Callable[[], Any]:
    return functools.partial(_towers(model, devices, algorithm, placement, jit).train_step, x, y)


def _configs(model: str, devices: Sequence[str], x: tf.Tensor, y: tf.Tensor,
             towers: Sequence[tuple[str, str]]) -> tuple[dict[str, Callable[[], Any]], dict]:
    """name -> step, and name -> error for what could not be built or run."""
    from reference import CentralStorageTrainer, MirroredTrainer

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    make = MODELS[model][0]
    builders: dict[str, Callable[[], Callable[[], Any]]] = {}
    for name, cls in ((MIRRORED, MirroredTrainer), ("CentralStorageStrategy",
                                                     CentralStorageTrainer)):
        for jit, wrap in ((False, strategy_step), (True, strategy_xla_step)):
            builders[name + (" +XLA" if jit else "")] = functools.partial(
                lambda cls, wrap: wrap(cls(make, _sgd, loss, list(devices)), x, y), cls, wrap)
    for algorithm, placement in towers:
        for jit in (False, True):
            builders[f"towers {algorithm}/{placement}" + (" +XLA" if jit else "")] = (
                functools.partial(_towers_step, model, devices, algorithm, placement, jit, x, y))
    steps, errors = {}, {}
    for name, build in builders.items():
        try:
            step = build()
            step()  # trace (and compile) outside the timing
            steps[name] = step
        except Exception as err:  # reported as a row
            errors[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"[:160]
    return steps, errors


def xla_rows(model: str, devices: Sequence[str], *, batch: int = 256, rounds: int = 13,
             towers: Sequence[tuple[str, str]] = (("naive", "parameter_device"),
                                                  ("naive", "replicated"))) -> list[dict]:
    """One row per configuration: median ms, paired ratio to MirroredStrategy (no XLA).

    Returns:
        ``[{"model", "config", "ms", "ratio", "error"}]`` (``error`` None when it ran).
    """
    x, y = make_batch(model, batch)
    steps, errors = _configs(model, devices, x, y, towers)
    samples = interleave(steps, rounds) if steps else {}
    base = samples.get(MIRRORED)
    rows = [{"model": model, "config": k, "ms": s.median * 1e3,
             "ratio": paired_ratio(s, base) if base else None, "error": None}
            for k, s in samples.items()]
    return rows + [{"model": model, "config": k, "ms": None, "ratio": None, "error": e}
                   for k, e in errors.items()]


def xla_difference(model: str, devices: Sequence[str], *, batch: int = 256,
                   steps: int = 3) -> dict[str, float]:
    """``TowerTrainer`` with and without XLA from the same weights on the same batches.

    Returns:
        ``{"loss": max |Δ first loss|, "weights": max |Δ weight| after ``steps`` steps,
        "weights_rel": that over max |weight|}``.
    """
    plain, xla = (_towers(model, devices, "naive", "parameter_device", j) for j in (False, True))
    xla.set_weights(plain.get_weights())
    losses = []
    for s in range(steps):
        x, y = make_batch(model, batch, seed=s)
        losses.append(abs(float(plain.train_step(x, y)) - float(xla.train_step(x, y))))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(plain.get_weights(),
                                                             xla.get_weights()))
    scale = max(float(np.max(np.abs(a))) for a in plain.get_weights())
    return {"loss": max(losses), "weights": diff, "weights_rel": diff / scale}


def xla_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as text: model, configuration, ms per step, ratio to MirroredStrategy."""
    lines = [f"{'model':<11} {'config':<40} {'ms':>7} {'vs Mirrored':>11}"]
    for r in rows:
        if r["error"]:
            lines.append(f"{r['model']:<11} {r['config']:<40} failed: {r['error']}")
        else:
            lines.append(f"{r['model']:<11} {r['config']:<40} {r['ms']:7.1f} "
                         f"{r['ratio']:11.2f}")
    return "\n".join(lines)


def xla_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections xla``: the XLA table and the XLA/no-XLA difference."""
    rows: list[dict] = []
    diffs = {}
    for model in args.models or list(MODELS):
        print(f"\n== XLA: {model}, batch {args.batch_size}, {args.towers} towers", flush=True)
        rows += xla_rows(model, devices[: args.towers], batch=args.batch_size,
                         rounds=args.step_rounds or (5 if args.quick else 13))
        diffs[model] = xla_difference(model, devices[: args.towers], batch=args.batch_size)
        print(f"XLA vs graph, same weights: {diffs[model]}")
    print(xla_table(rows))
    results["xla"], results["xla_difference"] = rows, diffs
    return True
