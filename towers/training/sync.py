"""Replica 0 -> every replica, and every replica checked against it.

::

    Keras writes replica 0 (tm.network, tm.optimizer)     set_weights, load_weights,
          │                                                a callback, load_model
          ▼
    Replicas.broadcast      weights ─▶ replica 1 … n-1; (replicated) optimizer state too
                            (towers/placement.py)
    Hyperparameters.follow  learning_rate, weight_decay, … ─▶ every replica's optimizer;
                            a Python number baked into the traced step ─▶ retrace
    TrainableWatch.changed  layer.trainable changed on replica 0 ─▶ every replica's layers
                            (the trainer rebuilds its reducer and retraces; sharded refuses)
    ReplicaCheck            every k steps: c[r][v] = (Σ_k b_k, Σ_k (k+1)·b_k) of v's bits
                            on each replica; the first v with c[r][v] != c[0][v] raises

Keras knows one model and one optimizer; a trainer holds one copy per replica
(:mod:`towers.placement`), so whatever Keras changes on the first is copied to the
others before the next step reads them. Keras reads ``trainable`` in Python when a step
is traced, so a change is followed by a retrace; a variable not trainable when the
trainer was built has no optimizer slot, so making it trainable is refused. The replica
checksum reads raw bits (0.0 differs from -0.0, NaN payloads count), weighted by position
(swapped elements differ); it runs outside the step, so the step's bits do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.guard.arguments import optional, positive_int
from towers.guard.errors import ReplicaMismatchError

__all__ = ["Hyperparameters", "ReplicaCheck", "TrainableWatch", "checksum", "trainable_flags"]


def _hyperparameters(optimizer: Any) -> dict[str, Any]:
    """What a callback may change on an optimizer: its config, minus its name. A wrapper's
    inner optimizer (``LossScaleOptimizer.inner_optimizer``) is compared by its own
    hyperparameters, not by its serialized form (a dict, with a ``shared_object_id`` when
    made inside ``load_model``), so a change is copied onto the inner object itself."""
    config = dict(optimizer.get_config())
    config.pop("name", None)
    # A serialized object (a LearningRateSchedule as the learning rate) is no value anyone
    # can set: Keras refuses to. Every replica's optimizer was made from the same config,
    # so its schedule follows the same iterations; its serialized form may still differ
    # after load_model (shared-object ids), which is no change.
    config = {k: v for k, v in config.items() if not isinstance(v, dict)}
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        config["inner_optimizer"] = _hyperparameters(inner)
    return config


def _changes(seen: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """What differs in ``now`` from ``seen`` (an inner optimizer's changes nested)."""
    out: dict[str, Any] = {}
    for key, value in now.items():
        if key == "inner_optimizer" and isinstance(value, dict):
            inner = _changes(seen.get(key) or {}, value)
            if inner:
                out[key] = inner
        elif seen.get(key) != value:
            out[key] = value
    return out


def _assign(optimizer: Any, changed: dict[str, Any]) -> None:
    """Set each changed hyperparameter on ``optimizer`` (an inner one's on the inner)."""
    for key, value in changed.items():
        if key == "inner_optimizer":
            _assign(optimizer.inner_optimizer, value)
        else:
            setattr(optimizer, key, value)


def _keys(changed: dict[str, Any]) -> set[str]:
    """The changed hyperparameters' names, an inner optimizer's included."""
    keys = {k for k in changed if k != "inner_optimizer"}
    inner = changed.get("inner_optimizer")
    return keys | _keys(inner) if isinstance(inner, dict) else keys


class Hyperparameters:
    """Replica 0's optimizer hyperparameters as last seen; :meth:`follow` copies a change.

    Example:
        >>> watch = Hyperparameters(trainer.optimizer)      # doctest: +SKIP
        >>> trainer.optimizer.weight_decay = 0.1; watch.follow(trainer)
    """

    def __init__(self, optimizer: Any) -> None:
        self.seen = _hyperparameters(optimizer)

    def follow(self, trainer: Any) -> None:
        """Copy what changed on ``trainer.optimizer`` since last seen to every replica's
        optimizer; retrace the step when anything but the learning rate (a variable every
        trace reads) changed."""
        now = _hyperparameters(trainer.optimizer)
        if now == self.seen:
            return
        changed = _changes(self.seen, now)
        for replica in trainer.replicas[1:]:
            _assign(replica.optimizer, changed)
        if _keys(changed) - {"learning_rate"}:
            trainer.retrace()
        self.seen = now


def _layers(model: keras.Model) -> list[keras.layers.Layer]:
    # Keras' own walk (what Layer.trainable's setter and model.trainable_variables use).
    return list(model._flatten_layers(include_self=True, recursive=True))


def trainable_flags(
    layers: Sequence[Any], weights: Sequence[Any]
) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Every layer's ``trainable`` and every variable's (``model.weights`` order)."""
    return (
        tuple(bool(layer.trainable) for layer in layers),
        tuple(bool(v.trainable) for v in weights),
    )


def _copy_flags(source: keras.Model, target: keras.Model) -> None:
    """Give ``target`` (a clone) ``source``'s flags: parents first, as Keras cascades them."""
    for mine, theirs in zip(_layers(source), _layers(target)):
        if theirs.trainable != mine.trainable:
            theirs.trainable = mine.trainable
    for mine, theirs in zip(source.weights, target.weights):
        theirs.trainable = mine.trainable


class TrainableWatch:
    """What ``trainer.model``'s trainable flags were when the step was last traced.

    Args:
        replicas: the trainer's replicas; replica 0's model is ``trainer.model``.
        placement: the trainer's placement name (``"sharded"`` cannot follow a change).
    """

    def __init__(self, replicas: Sequence[Any], placement: str) -> None:
        model = replicas[0].model
        self.placement = placement
        # a built model's layers and variables are fixed: walk them once, read flags per step
        self.layers, self.weights = _layers(model), list(model.weights)
        self.flags = trainable_flags(self.layers, self.weights)
        self.built = {id(v) for v in model.trainable_variables}

    def changed(self, replicas: Sequence[Any]) -> bool:
        """True when ``trainer.model``'s flags changed since the last call (then every
        replica has been given them); False when nothing changed.

        Raises:
            ValueError: under ``variables="sharded"`` (any change), when every variable
                is frozen, or when a variable that was not trainable when the trainer was
                built is trainable now; nothing is changed then (the replicas keep their
                flags).
        """
        model = replicas[0].model
        flags = trainable_flags(self.layers, self.weights)
        if flags == self.flags:
            return False
        self._check(model)
        for replica in replicas[1:]:
            _copy_flags(model, replica.model)
        self.flags = flags
        return True

    def _check(self, model: keras.Model) -> None:
        if self.placement == "sharded":
            raise ValueError(
                "variables='sharded' cannot follow a change of trainable after the trainer "
                "was built: its shard plan and the owners' optimizer slots are cut for the "
                "trainable variables it was built with. Set layer.trainable before building "
                "the trainer, or use variables='replicated' (or 'parameter_device'), which "
                "follow the change"
            )
        if not model.trainable_variables:
            raise ValueError(
                "trainable: every variable of the model is frozen now, so a step has nothing "
                "to train; unfreeze a layer (or stop calling train_step)"
            )
        new = [v for v in model.trainable_variables if id(v) not in self.built]
        if new:
            names = ", ".join(getattr(v, "path", v.name) for v in new)
            raise ValueError(
                f"trainable: {names} became trainable but was not trainable when the trainer "
                "was built, so its optimizer has no state for it. Build the trainer with "
                "every layer you will train trainable (freezing later is followed), or "
                "build a new trainer"
            )


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
    """Compare the replicas every ``every`` steps (None or 0: never).

    Raises:
        ValueError: ``every`` is not None or a positive int.
    """

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
        """Raise when any replica's copy of a variable differs from replica 0's.

        Raises:
            ReplicaMismatchError: naming the first variable that differs and the replicas.
        """
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
