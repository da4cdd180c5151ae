"""CentralStorageStrategy reference: one copy of each variable, on the parameter device.

The reference for towers' ``variables="parameter_device"`` placement::

    param device: variables ──read──▶ tower 0 … tower n (fwd/bwd)
                      ▲                     │ gradients
                      └──── apply ◀── sum ──┘

It cannot run everything. Any variable without an aggregation method that is
assigned inside ``strategy.run`` makes it fail with "You must specify an aggregation
method to update a AggregatingVariable in Replica Context" (measured on TF 2.21 /
Keras 3.15, a ValueError):

- BatchNormalization (raised from ``BatchNormalization.call``: moving statistics);
- layers that draw random numbers in training, e.g. Dropout (their SeedGenerator state);
- Keras 3 Nadam (its ``u_product``), LossScaleOptimizer, optimizers with ``use_ema=True``.

These raise :class:`ReferenceUnavailable`: at construction where the model or the
optimizer shows the cause, otherwise from the first step, converting (and chaining)
the strategy's own error. Either way the advice is to compare against
:class:`reference.MirroredTrainer` instead.
"""

from __future__ import annotations

import re
from typing import Any

import keras
import tensorflow as tf

from reference._loop import (
    LossLike,
    ModelLike,
    OptimizerLike,
    ReferenceUnavailable,
    StrategyTrainer,
    check_devices,
)

__all__ = ["CentralStorageTrainer", "known_failures"]

_INSTEAD = "compare against MirroredTrainer instead"
_AGGREGATION_ERROR = "You must specify an aggregation method to update a AggregatingVariable"


def _layer_causes(model: keras.Model) -> list[str]:
    causes = []
    for layer in model._flatten_layers(include_self=False):
        name = f"{layer.name} ({type(layer).__name__})"
        if isinstance(layer, keras.layers.BatchNormalization):
            causes.append(f"{name}: BatchNormalization.call updates its moving statistics")
        elif getattr(layer, "_seed_generators", None):
            causes.append(f"{name}: it draws random numbers, updating its SeedGenerator state")
    return causes


def _optimizer_causes(optimizer: keras.optimizers.Optimizer) -> list[str]:
    kind = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.Nadam):
        return [f"{kind}: Keras 3 Nadam updates its u_product variable"]
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return [f"{kind}: it updates its loss-scale state"]
    if getattr(optimizer, "use_ema", False):
        return [f"{kind}(use_ema=True): it updates its moving-average variables"]
    return []


def known_failures(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> list[str]:
    """Why CentralStorageStrategy cannot train this pair (empty when nothing is known).

    Each cause is a variable without an aggregation method that is assigned in replica
    context, which CentralStorageStrategy rejects with "You must specify an aggregation
    method to update a AggregatingVariable in Replica Context" (measured, TF 2.21 /
    Keras 3.15).

    Args:
        model: the model, built.
        optimizer: the optimizer.

    Returns:
        One line per cause, naming the layer or optimizer.
    """
    return _layer_causes(model) + _optimizer_causes(optimizer)


class CentralStorageTrainer(StrategyTrainer):
    """Train with ``tf.distribute.experimental.CentralStorageStrategy`` and a custom loop.

    The same constructor as ``towers.TowerTrainer``; TowerTrainer-only keywords
    (``all_reduce=``, ``variables=``, ``semantics=``, …) are accepted and ignored.
    Model and optimizer are created and built inside the strategy's scope, as in
    :class:`reference.MirroredTrainer`.

    Args:
        model: a built ``keras.Model`` or a zero-argument factory returning one.
        optimizer: a Keras optimizer or a zero-argument factory returning one.
        loss: a ``keras.losses.Loss``, a loss name, or ``(y_true, y_pred) -> per-example``.
        devices: the compute devices, e.g. ``DEVICES[:4]``.
        parameter_device: where the variables live (default: ``devices[0]``).
        **_ignored: TowerTrainer-only keywords; ignored.

    Raises:
        ReferenceUnavailable: the model has BatchNormalization, or the optimizer is
            Nadam: CentralStorageStrategy itself cannot train them.
        TypeError, ValueError: bad devices, model, optimizer or loss.

    Example:
        >>> trainer = CentralStorageTrainer(make_model, keras.optimizers.SGD(0.1), "mse",
        ...                                 DEVICES[:4])              # doctest: +SKIP
        >>> loss = trainer.train_step(x, y)                            # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: OptimizerLike,
        loss: LossLike,
        devices: list[str],
        *,
        parameter_device: str | None = None,
        **_ignored: Any,
    ) -> None:
        names = check_devices(devices)
        param = names[0] if parameter_device is None else parameter_device
        param = check_devices([param], "parameter_device")[0]
        strategy = tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=names, parameter_device=param
        )
        super().__init__(strategy, model, optimizer, loss)
        causes = known_failures(self.model, self.optimizer)
        if causes:
            raise ReferenceUnavailable(
                "CentralStorageStrategy cannot train this model/optimizer: "
                + "; ".join(causes)
                + f" from replica context, and the strategy's variables have no aggregation "
                f"method ('{_AGGREGATION_ERROR} in Replica Context'); {_INSTEAD}"
            )

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> tf.Tensor:
        """One synchronous step; see :meth:`StrategyTrainer.train_step`.

        Raises:
            ReferenceUnavailable: the strategy failed in a known way (a variable updated
                from replica context without an aggregation method).
        """
        try:
            return super().train_step(x, y, sample_weight)
        except (ValueError, RuntimeError) as err:
            if _AGGREGATION_ERROR not in str(err):
                raise
            raise ReferenceUnavailable(
                f"CentralStorageStrategy cannot train this model/optimizer: {_where(err)} "
                f"assigns a variable from replica context ('{_AGGREGATION_ERROR} in Replica "
                f"Context', the chained error); {_INSTEAD}"
            ) from err


def _where(err: Exception) -> str:
    """The layer named in a Keras error ("when calling Counter.call()"), else "a step"."""
    match = re.search(r"when calling (\w+)\.call\(\)", str(err))
    return f"layer {match.group(1)}" if match else "a step"
