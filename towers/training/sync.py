"""Replica 0 -> every replica: what ``towers.TowerModel`` copies so that Keras's writes land.

::

    Keras writes replica 0 (tm.network, tm.optimizer)     set_weights, load_weights,
          │                                                a callback, load_model
          ▼
    copy_first_replica      weights ─▶ replica 1 … n-1; (replicated) optimizer state too
    Hyperparameters.follow  learning_rate, weight_decay, … ─▶ every replica's optimizer;
                            a Python number baked into the traced step ─▶ retrace

Keras knows one model and one optimizer; a trainer holds one copy per replica
(:mod:`towers.placement`), so whatever Keras changes on the first must be copied to the
others before the next step reads them. ``sharded`` replicas own different optimizer
shards: only their weights are copied. The copies are
:func:`towers.allreduce.broadcast` (``"flat"``: replica 0 sends to each, through ``send``),
so they are bitwise and recorded like every other transfer.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers.allreduce.collectives import broadcast

__all__ = ["Hyperparameters", "copy_first_replica"]


def copy_first_replica(trainer: Any) -> None:
    """Broadcast replica 0's weights to every other replica, and (``replicated``) its
    optimizer variables to every other replica's optimizer (same structure: same model,
    same kind): one :func:`~towers.allreduce.broadcast` per dtype of all those variables
    flattened into one buffer (a call per variable would cost far more than the copy)."""
    replicas = trainer.replicas
    if len(replicas) < 2:
        return
    devices = [r.device for r in replicas]
    copied = [list(r.model.weights) for r in replicas]
    if trainer.placement.name == "replicated":
        copied = [w + list(r.optimizer.variables) for w, r in zip(copied, replicas)]
    rows = list(zip(*copied))  # rows[j]: variable j on every replica
    for dtype in dict.fromkeys(row[0].dtype for row in rows):
        group = [row for row in rows if row[0].dtype == dtype]
        with tf.device(devices[0]):
            flat = tf.concat([tf.reshape(row[0].value, [-1]) for row in group], axis=0)
        copies = broadcast(flat, devices, algorithm="flat")
        sizes = [int(row[0].shape.num_elements()) for row in group]
        for i in range(1, len(replicas)):
            with tf.device(devices[i]):
                pieces = tf.split(copies[i], sizes)
                for row, piece in zip(group, pieces):
                    row[i].assign(tf.reshape(piece, row[i].shape))


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
