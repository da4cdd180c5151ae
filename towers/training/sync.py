"""The replicas kept one model: the towers' state combined, replica 0's changes followed,
every replica checked against replica 0.

::

    combine_non_trainable   every tower's new non-trainable values ─▶ one value each, by
                            its Keras aggregation (AGGREGATIONS), assigned to every replica
    Hyperparameters.follow  replica 0's learning_rate, weight_decay, … ─▶ every replica
    TrainableWatch.changed  layer.trainable changed on replica 0 ─▶ every replica's layers
    ReplicaCheck            every k steps: a checksum of each variable's raw bits on each
                            replica; the first that differs from replica 0's raises
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.primitives import send
from towers.allreduce.parameter_device import reduce_on
from towers.guard.arguments import optional, positive_int
from towers.guard.errors import ReplicaMismatchError

__all__ = ["AGGREGATIONS", "Hyperparameters", "ReplicaCheck", "TrainableWatch", "checksum",
           "combine_non_trainable"]


AGGREGATIONS = ("mean", "none", "sum", "only_first_replica")
"""How :func:`combine_non_trainable` combines a variable's towers, by its Keras
``aggregation`` (``add_weight(aggregation=...)``):

=====================  ==================================================================
``mean``, ``none``     floating state: the mean over the towers that saw examples
``sum``                a running total: ``old + Σ_i (new_i − old)``, as one device adds
``only_first_replica`` tower 0's value
``none``, integer      a seed generator's state: tower 0's; other integer state is refused
=====================  ==================================================================
State no tower changed is kept bitwise (``(x + x + x) / 3`` is not always ``x``)."""


def _rule(variable: Any, value: tf.Tensor) -> str:
    """The rule of :data:`AGGREGATIONS` for a changed non-trainable ``variable`` (a
    ``ValueError`` for integer state with no declared aggregation)."""
    aggregation = str(getattr(variable, "aggregation", "none") or "none").lower()
    if aggregation in ("sum", "only_first_replica"):
        return aggregation
    if value.dtype.is_floating:
        return "mean"
    if "seed_generator_state" in (getattr(variable, "path", None) or variable.name):
        return "only_first_replica"
    name = getattr(variable, "path", None) or variable.name
    raise ValueError(
        f"non-trainable variable {name!r} ({value.dtype.name}) is changed by the towers, and "
        "an average of integers has no meaning: declare how its towers combine with "
        "add_weight(..., aggregation=...): 'sum' (a count each tower adds to), "
        "'only_first_replica' (tower 0's value) or 'mean'")


def combine_non_trainable(results: Sequence[Any], *, first_tower: bool, device: str,
                          variables: Sequence[Any] | None = None) -> list[tf.Tensor]:
    """One value per non-trainable variable, formed on ``device`` from every tower's
    :class:`~towers.tower.TowerResult` by its rule in :data:`AGGREGATIONS` (``variables``:
    replica 0's; None: all ``none``), or tower 0's for all when ``first_tower``.

    Raises:
        ValueError: changed integer state without a declared aggregation (when traced).
    """
    combined = []
    with tf.device(device):
        counts = [send(r.examples, device, note="state") for r in results]
        for j in range(len(results[0].non_trainable)):
            values = [r.non_trainable[j] for r in results]
            unchanged = all(r.changed is not None and r.changed[j] is False for r in results)
            if first_tower or unchanged:  # (known when traced)
                combined.append(send(values[0], device, note="state"))
                continue
            rule = (_rule(variables[j], values[0]) if variables is not None
                    else "mean" if values[0].dtype.is_floating else "only_first_replica")
            if rule == "only_first_replica":
                combined.append(send(values[0], device, note="state"))
            elif rule == "sum":
                old = tf.convert_to_tensor(variables[j].value) if variables else values[0]
                deltas = [send(v, device, note="state") - old for v in values]
                combined.append(old + reduce_on(deltas, device, "sum"))
            else:
                masked = [tf.where(c > 0, send(v, device, note="state"), tf.zeros_like(v))
                          for v, c in zip(values, counts)]  # fmt: skip
                seen = tf.add_n([tf.cast(c > 0, values[0].dtype) for c in counts])
                combined.append(reduce_on(masked, device, "sum") / seen)
    return combined


def _hyperparameters(optimizer: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """What a callback may change on an optimizer, by attribute path: its config minus its
    name and serialized objects (a schedule follows the same iterations everywhere); a
    wrapper's inner optimizer's under ``("inner_optimizer", ...)``."""
    found = {(*path, k): v for k, v in optimizer.get_config().items()
             if k != "name" and not isinstance(v, dict)}  # fmt: skip
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        found.update(_hyperparameters(inner, (*path, "inner_optimizer")))
    return found


class Hyperparameters:
    """Replica 0's optimizer hyperparameters as last seen; :meth:`follow` copies a change."""

    def __init__(self, optimizer: Any) -> None:
        self.seen = _hyperparameters(optimizer)

    def follow(self, trainer: Any) -> None:
        """Copy what changed on ``trainer.optimizer`` to every replica's optimizer; retrace
        when anything but the learning rate (a variable every trace reads) changed."""
        now = _hyperparameters(trainer.optimizer)
        if now == self.seen:
            return
        changed = {path: v for path, v in now.items() if self.seen.get(path) != v}
        for replica in trainer.replicas[1:]:
            for path, value in changed.items():
                owner = replica.optimizer
                for name in path[:-1]:
                    owner = getattr(owner, name)
                setattr(owner, path[-1], value)
        if {path[-1] for path in changed} - {"learning_rate"}:
            trainer.retrace()
        self.seen = now


def _layers(model: keras.Model) -> list[keras.layers.Layer]:  # Keras's own walk
    return list(model._flatten_layers(include_self=True, recursive=True))


def _copy_flags(source: keras.Model, target: keras.Model) -> None:
    """Give ``target`` (a clone) ``source``'s flags: parents first, as Keras cascades them."""
    for mine, theirs in zip(_layers(source), _layers(target)):
        if theirs.trainable != mine.trainable:
            theirs.trainable = mine.trainable
    for mine, theirs in zip(source.weights, target.weights):
        theirs.trainable = mine.trainable


class TrainableWatch:
    """What ``trainer.model``'s trainable flags were when the step was last traced
    (``placement``: the trainer's placement name; ``"sharded"`` cannot follow a change)."""

    def __init__(self, replicas: Sequence[Any], placement: str) -> None:
        model = replicas[0].model
        self.placement = placement
        # a built model's layers and variables are fixed: walk them once, read flags per step
        self.layers, self.weights = _layers(model), list(model.weights)
        self.flags = self._flags()
        self.built = {id(v) for v in model.trainable_variables}

    def _flags(self) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        return (tuple(bool(x.trainable) for x in self.layers),
                tuple(bool(v.trainable) for v in self.weights))

    def changed(self, replicas: Sequence[Any]) -> bool:
        """Whether replica 0's flags changed since the last call (then every replica has them).

        Raises:
            ValueError: any change under ``variables="sharded"``, every variable frozen, or
                a variable trainable now that was not when the trainer was built (nothing
                is changed then).
        """
        model = replicas[0].model
        flags = self._flags()
        if flags == self.flags:
            return False
        self._check(model)
        for replica in replicas[1:]:
            _copy_flags(model, replica.model)
        self.flags = flags
        return True

    def _check(self, model: keras.Model) -> None:
        if self.placement == "sharded":
            raise ValueError("variables='sharded' cannot follow a change of trainable after the "
                             "trainer was built: its shard plan and the owners' optimizer slots "
                             "are cut for the trainable variables it was built with. Set "
                             "layer.trainable before building the trainer, or use "
                             "variables='replicated' (or 'parameter_device'), which follow it")
        if not model.trainable_variables:
            raise ValueError("trainable: every variable of the model is frozen now, so a step "
                             "has nothing to train; unfreeze a layer (or stop calling train_step)")
        new = [v for v in model.trainable_variables if id(v) not in self.built]
        if new:
            names = ", ".join(getattr(v, "path", v.name) for v in new)
            raise ValueError(f"trainable: {names} became trainable but was not trainable when "
                             "the trainer was built, so its optimizer has no state for it. Build "
                             "the trainer with every layer you will train trainable (freezing "
                             "later is followed), or build a new trainer")


_BITS = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def checksum(value: tf.Tensor) -> tf.Tensor:
    """Two int64 of ``value``'s bits: their sum and their position-weighted sum."""
    if value.dtype.is_floating:
        bits = tf.bitcast(value, _BITS[value.dtype.size])
    else:
        bits = tf.cast(value, tf.int8) if value.dtype.is_bool else value
    bits = tf.reshape(tf.cast(bits, tf.int64), [-1])
    position = tf.range(1, tf.size(bits, out_type=tf.int64) + 1, dtype=tf.int64)
    return tf.stack([tf.reduce_sum(bits), tf.reduce_sum(bits * position)])


def _variables(replica: Any) -> list[tf.Variable]:
    # variables="sharded": each optimizer holds other slots (its own shard's); weights only
    state = [] if getattr(replica, "sharded", False) else replica.optimizer.variables
    return [*replica.model.weights, *state]


class ReplicaCheck:
    """Compare the replicas every ``every`` steps (None: never; else a positive int)."""

    def __init__(self, every: int | None) -> None:
        optional(positive_int, "check_replicas_every", every)
        self.every, self.steps = every, 0
        self._sums: Any = None

    def after_step(self, replicas: Sequence[Any], algorithm: str) -> None:
        """Count a step; on every ``every``-th, :meth:`check` the replicas."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self.check(replicas, algorithm)

    def check(self, replicas: Sequence[Any], algorithm: str) -> None:
        """Raises ReplicaMismatchError naming the first variable a replica holds other
        bits of than replica 0, and the replicas."""
        if len(replicas) < 2:
            return
        if self._sums is None:  # one graph for every replica's checksums, traced once
            self._sums = tf.function(lambda: [self._on(r) for r in replicas], autograph=False)
        sums = [np.asarray(s) for s in self._sums()]
        names = [getattr(v, "path", None) or v.name for v in _variables(replicas[0])]
        for j, name in enumerate(names):
            differ = [r for r in range(1, len(sums)) if (sums[r][j] != sums[0][j]).any()]
            if differ:
                step = int(replicas[0].optimizer.iterations)
                raise ReplicaMismatchError(step, name, differ, algorithm)

    @staticmethod
    def _on(replica: Any) -> tf.Tensor:
        with tf.device(replica.device):
            return tf.stack([checksum(tf.convert_to_tensor(v)) for v in _variables(replica)])
