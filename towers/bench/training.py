"""The training-step table: towers against a single device and tf.distribute.

Configurations, all built from the same seeded model and SGD, on one fixed batch
of 256 random examples, pre-converted to tensors:

- ``single device``: a plain Keras custom step (tape, ``apply_gradients``) on tower 0;
- ``MirroredStrategy``: its default ``CollectiveAllReduce`` (keys from
  :func:`reference.mirrored.collective_all_reduce`), ``MirroredStrategy (R1D)``:
  ``ReductionToOneDevice``, and ``CentralStorageStrategy``. The strategies and models
  come from :mod:`reference`; the loop is written here, fed a distributed batch made
  once (``reference``'s ``train_step`` builds a distributed iterator per call, which
  would time the iterator, not the step);
- ``towers <algorithm>/<placement>``: ``TowerTrainer.train_step`` on the tensors;
- ``towers noop/replicated``: no exchange at all, the ceiling (not a valid step);
- ``towers fused(<algorithm>)/<placement>``: every gradient packed into one flat buffer
  per tower (:func:`towers.allreduce.bucketed.bucketed` with no size limit), one
  all-reduce per step (see :func:`fused_reducers`).

Every configuration's first call returns the loss of the same initial weights on
the same batch: ``first_loss`` must agree across the table. Steps are then timed
round-robin (:func:`towers.bench.timing.interleave`); ``ratio`` is the median over
rounds of the step time over MirroredStrategy's in the same round.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers import allreduce
from towers.allreduce.bucketed import bucketed
from towers.bench.timing import interleave, paired_ratio
from towers.step import PLACEMENTS, TowerTrainer
from towers.training.models import mlp, mnist_cnn

__all__ = [
    "BASELINES",
    "MIRRORED",
    "MODELS",
    "StepConfig",
    "fused_reducers",
    "make_batch",
    "profile_steps",
    "run_model",
    "step_configs",
]

MODELS: dict[str, tuple[Callable[[], keras.Model], tuple[int, ...]]] = {
    "conv-mnist": (lambda: mnist_cnn(0), (28, 28, 1)),
    "mlp": (lambda: mlp(seed=0), (784,)),
}
"""Model name -> (factory, input shape): ``mnist_cnn`` and the 784-2048-2048-10 MLP."""

MIRRORED = "MirroredStrategy"
BASELINES = ("single device", MIRRORED, "MirroredStrategy (R1D)", "CentralStorageStrategy")
LEARNING_RATE = 0.01


@dataclasses.dataclass
class StepConfig:
    """One row: ``step()`` runs one synchronous training step and returns its loss."""

    name: str
    kind: str  # "baseline", "tf.distribute", "towers" or "ceiling"
    step: Callable[[], tf.Tensor]
    algorithm: str = ""
    placement: str = ""


def make_batch(
    model: str, batch: int = 256, seed: int = 0, scale: float = 1.0
) -> tuple[tf.Tensor, tf.Tensor]:
    """A fixed batch of random inputs and labels 0-9 for ``model`` (a :data:`MODELS` key)."""
    rng = np.random.default_rng(seed)
    shape = MODELS[model][1]
    x = (rng.random((batch, *shape), dtype=np.float32) * scale).astype(np.float32)
    y = rng.integers(0, 10, size=batch).astype(np.int32)
    return tf.constant(x), tf.constant(y)


def _per_example(y: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LEARNING_RATE)


def single_device_step(
    make_model: Callable[[], keras.Model], device: str, x: tf.Tensor, y: tf.Tensor
) -> Callable[[], tf.Tensor]:
    """The plain Keras custom step on one device: no split, no exchange."""
    with tf.device(device):
        model, optimizer = make_model(), _sgd()
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(_per_example(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def run() -> tf.Tensor:
        with tf.device(device):
            return step(x, y)

    return run


def strategy_step(trainer: Any, x: tf.Tensor, y: tf.Tensor) -> Callable[[], tf.Tensor]:
    """A fair custom loop over ``trainer.strategy``: the batch is distributed once, up front.

    Args:
        trainer: a :class:`reference.MirroredTrainer` or :class:`reference.CentralStorageTrainer`
            (its strategy, and the model and optimizer built in its scope).
        x, y: the global batch.
    """
    strategy, model, optimizer = trainer.strategy, trainer.model, trainer.optimizer
    batch = int(x.shape[0])
    dataset = tf.data.Dataset.from_tensors((x, y))
    inputs = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica_step(xs: tf.Tensor, ys: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            per_example = _per_example(ys, model(xs, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(inputs: Any) -> tf.Tensor:
        per_replica = strategy.run(replica_step, args=inputs)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return lambda: step(inputs)


def _baselines(
    make_model: Callable[[], keras.Model], devices: Sequence[str], x: tf.Tensor, y: tf.Tensor,
    names: Sequence[str] = BASELINES,
) -> list[StepConfig]:
    """The reference steps called ``names`` (only those are built: the memory table
    measures one configuration per process)."""
    from reference import CentralStorageTrainer, MirroredTrainer

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    build: dict[str, Callable[[], StepConfig]] = {
        "single device": lambda: StepConfig(
            "single device", "baseline", single_device_step(make_model, devices[0], x, y)),
        MIRRORED: lambda: StepConfig(MIRRORED, "tf.distribute", strategy_step(
            MirroredTrainer(make_model, _sgd, loss, list(devices)), x, y)),
        "MirroredStrategy (R1D)": lambda: StepConfig(
            "MirroredStrategy (R1D)", "tf.distribute", strategy_step(MirroredTrainer(
                make_model, _sgd, loss, list(devices),
                cross_device_ops="reduction_to_one_device"), x, y)),
        "CentralStorageStrategy": lambda: StepConfig(
            "CentralStorageStrategy", "tf.distribute", strategy_step(
                CentralStorageTrainer(make_model, _sgd, loss, list(devices)), x, y)),
    }
    return [build[name]() for name in BASELINES if name in names]


def towers_config(
    make_model: Callable[[], keras.Model], devices: Sequence[str], x: tf.Tensor, y: tf.Tensor,
    algorithm: str | Any, placement: str, name: str | None = None,
) -> StepConfig:
    """``TowerTrainer.train_step`` with ``algorithm`` (name or callable) and ``placement``."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = TowerTrainer(make_model, _sgd, loss, devices=list(devices),
                           all_reduce=algorithm, variables=placement,
                           check_algorithm=algorithm != "noop")  # the ceiling does not sum
    label = name or (algorithm if isinstance(algorithm, str) else algorithm.__name__)
    kind = "ceiling" if algorithm == "noop" else "towers"
    return StepConfig(f"towers {label}/{placement}", kind, lambda: trainer.train_step(x, y),
                      algorithm=label, placement=placement)


def fused_reducers() -> dict[str, Callable[[], Any]]:
    """Flat-buffer reducers (all of a step's gradients in one bucket): label -> factory."""
    return {f"fused({name})": functools.partial(bucketed, name, None)
            for name in ("naive", "parameter_device")}


def step_configs(
    model: str, devices: Sequence[str], x: tf.Tensor, y: tf.Tensor, *,
    algorithms: Sequence[str] | None = None, placements: Sequence[str] = tuple(PLACEMENTS),
    ceiling: bool = True, extra: dict[str, Callable[[], Any]] | None = None,
) -> tuple[list[StepConfig], dict[str, str]]:
    """Every configuration for ``model``; those that cannot be built are returned as errors.

    Args:
        extra: more towers reducers, label -> zero-argument factory of an algorithm or
            a ``GradientReducer`` (called once per configuration: reducers keep state).
    """
    make_model = MODELS[model][0]
    configs, errors = _baselines(make_model, devices, x, y), {}
    names = list(allreduce.ALGORITHMS if algorithms is None else algorithms)
    jobs: list[tuple[str, Callable[[], Any], str]] = [
        (a, functools.partial(str, a), p) for a in names for p in placements
    ]
    jobs += [(k, f, p) for k, f in (extra or {}).items() for p in placements]
    if ceiling:
        jobs.append(("noop", functools.partial(str, "noop"), "replicated"))
    for label, factory, placement in jobs:
        try:
            configs.append(towers_config(make_model, devices, x, y, factory(), placement, label))
        except Exception as err:  # reported as a row
            errors[f"towers {label}/{placement}"] = f"{type(err).__name__}: {err}"[:160]
    return configs, errors


def _first_losses(configs: list[StepConfig], errors: dict[str, str]) -> dict[str, float]:
    losses = {}
    for c in configs:
        try:
            losses[c.name] = float(c.step())
        except Exception as err:  # reported as a row
            errors[c.name] = f"{type(err).__name__}: {str(err).splitlines()[0]}"[:160]
    return losses


def _best_tf(configs: list[StepConfig], samples: dict[str, Any]) -> str | None:
    """The tf.distribute configuration with the lowest paired ratio to MirroredStrategy."""
    names = [c.name for c in configs if c.kind == "tf.distribute" and c.name in samples]
    if not names or MIRRORED not in samples:
        return min(names, key=lambda k: samples[k].median) if names else None
    return min(names, key=lambda k: paired_ratio(samples[k], samples[MIRRORED]))


def _rows(model: str, configs: list[StepConfig], samples: dict[str, Any],
          losses: dict[str, float], errors: dict[str, str]) -> list[dict[str, Any]]:
    best_tf = _best_tf(configs, samples)
    rows = []
    for c in configs:
        s = samples.get(c.name)
        row: dict[str, Any] = {
            "model": model, "config": c.name, "kind": c.kind, "algorithm": c.algorithm,
            "placement": c.placement, "first_loss": losses.get(c.name),
            "ms": None, "min_ms": None, "cpu_ms": None, "ratio": None, "ratio_best_tf": None,
            "best_tf": best_tf, "error": errors.get(c.name, ""),
        }
        if s is not None:
            row.update(ms=s.median * 1e3, min_ms=s.minimum * 1e3, cpu_ms=s.cpu_median * 1e3)
            if MIRRORED in samples:
                row["ratio"] = paired_ratio(s, samples[MIRRORED])
            if best_tf is not None:
                row["ratio_best_tf"] = paired_ratio(s, samples[best_tf])
        rows.append(row)
    rows += [{"model": model, "config": k, "kind": "towers", "error": v,
              **dict.fromkeys(("algorithm", "placement", "first_loss", "ms", "min_ms", "cpu_ms",
                               "ratio", "ratio_best_tf", "best_tf"))}
             for k, v in errors.items() if k not in {c.name for c in configs}]
    return rows


def run_model(
    model: str, devices: Sequence[str], *, batch: int = 256, rounds: int = 13, calls: int = 1,
    verbose: bool = False, **options: Any,
) -> list[dict[str, Any]]:
    """Build every configuration for ``model``, check first losses, time them interleaved."""
    x, y = make_batch(model, batch)
    configs, errors = step_configs(model, devices, x, y, **options)
    losses = _first_losses(configs, errors)
    runnable = {c.name: c.step for c in configs if c.name not in errors}
    samples = interleave(runnable, rounds, calls=calls, warmup=1, verbose=verbose,
                         label=f"training steps: {model}, batch {batch}, {len(devices)} towers")
    rows = _rows(model, configs, samples, losses, errors)
    del configs, runnable
    gc.collect()
    return rows


def profile_steps(
    model: str, devices: Sequence[str], names: Sequence[str], batch: int = 256
) -> dict[str, Callable[[], tf.Tensor]]:
    """Fresh step callables for the named configurations (registry algorithms only)."""
    x, y = make_batch(model, batch)
    make_model = MODELS[model][0]
    configs = _baselines(make_model, devices, x, y, names)
    fused = fused_reducers()
    for name in names:
        if name.startswith("towers "):
            label, placement = name.removeprefix("towers ").rsplit("/", 1)
            algorithm = fused[label]() if label in fused else label
            configs.append(towers_config(make_model, devices, x, y, algorithm, placement, label))
    return {c.name: c.step for c in configs}
