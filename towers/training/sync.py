"""Replica 0 -> every replica: what ``towers.TowerModel`` copies so that Keras's writes land.

::

    Keras writes replica 0 (tm.network, tm.optimizer)     set_weights, load_weights,
          │                                                a callback, load_model
          ▼
    broadcast(trainer)      weights ─▶ replica 1 … n-1; (replicated) optimizer state too
    Hyperparameters.follow  learning_rate, weight_decay, … ─▶ every replica's optimizer;
                            a Python number baked into the traced step ─▶ retrace

Keras knows one model and one optimizer; a trainer holds one copy per replica
(:mod:`towers.placement`), so whatever Keras changes on the first must be copied to the
others before the next step reads them. ``sharded`` replicas own different optimizer
shards: only their weights are copied.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["Hyperparameters", "broadcast"]


def broadcast(trainer: Any) -> None:
    """Copy replica 0's weights to every other replica, and (``replicated``) its optimizer
    variables to every other replica's optimizer (same structure: same model, same kind)."""
    first = trainer.replicas[0]
    for replica in trainer.replicas[1:]:
        with tf.device(replica.device):
            for source, target in zip(first.model.weights, replica.model.weights):
                target.assign(source.value)
            if trainer.placement.name == "replicated":
                for source, target in zip(first.optimizer.variables, replica.optimizer.variables):
                    target.assign(source.value)


def _hyperparameters(optimizer: Any) -> dict[str, Any]:
    """What a callback may change on an optimizer: its config, minus its name."""
    config = dict(optimizer.get_config())
    config.pop("name", None)
    return config


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
        changed = {k: v for k, v in now.items() if self.seen.get(k) != v}
        for replica in trainer.replicas[1:]:
            for key, value in changed.items():
                setattr(replica.optimizer, key, value)
        if set(changed) - {"learning_rate"}:
            trainer.retrace()
        self.seen = now
