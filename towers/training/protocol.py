"""What the training tools need of a trainer, as a ``typing.Protocol`` (so that
``towers.training`` never imports :mod:`towers.step`: no import cycle)."""

from __future__ import annotations

from typing import Any, Protocol

import keras

from towers.placement import Replicas

__all__ = ["Trainer"]


class Trainer(Protocol):
    """The part of :class:`towers.TowerTrainer` that inference, checkpoints, sync and export use."""

    devices: list[str]
    parameter_device: str
    algorithm: Any
    loss_fn: Any
    loss_reduction: str

    @property
    def replicas(self) -> Replicas: ...

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
