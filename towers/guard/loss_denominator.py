"""``loss_denominator``: what each tower divides its loss sum by, for ports of other loops.

towers divides every tower's (weighted) loss sum by the true global batch, as
``tf.nn.compute_average_loss(..., global_batch_size=B)`` does. Loops written for
``tf.distribute`` do not always: TensorFlow's tutorial "Custom training with
tf.distribute.Strategy" calls ``tf.nn.compute_average_loss(per_example_loss)``
without ``global_batch_size``, which divides each replica's sum by *its own shard
size × replicas*; older versions pass a constant ``GLOBAL_BATCH_SIZE``. On an even
batch all three agree; on an uneven last batch they do not::

    batch 10 over 4 towers: shards 3 3 3 1
    "global"       every tower ÷ 10                    (the true mean: towers' default)
    64 (constant)  every tower ÷ 64                    (the tutorial's GLOBAL_BATCH_SIZE)
    "per_replica"  ÷ 12   ÷ 12   ÷ 12   ÷ 4            (shard × replicas: the tutorial's
                                                        rule; the last example weighs 3×)

A port that must reproduce such a loop exactly passes the same rule here; the
difference to the true mean is then a choice the code states, not a bug to hunt.
Integer denominators divide as ``compute_average_loss`` does (an int32 size), so a
port is bitwise the tutorial's division; a non-integer constant divides in float.
Empty towers never run the model, so ``per_replica``'s zero never divides.
"""

from __future__ import annotations

import numbers
from typing import Any

import tensorflow as tf

__all__ = ["LOSS_DENOMINATORS", "axis_value", "check_loss_denominator", "tower_divisor"]

LOSS_DENOMINATORS = ("global", "per_replica")
"""The named rules; a positive number is the third kind (a constant)."""

_DIVIDED = ("sum_over_batch_size", "mean")
"""Keras reductions whose divisor is the batch size (the ones a denominator replaces)."""


def check_loss_denominator(value: Any, reduction: str) -> str | float:
    """``value`` checked: ``"global"``, ``"per_replica"`` or a positive finite number.

    Args:
        value: the trainer's ``loss_denominator`` argument.
        reduction: the loss's Keras reduction (:func:`towers.training.keras_loss.loss_reduction`).

    Returns:
        The rule's name, or the constant as a float.

    Raises:
        ValueError: another value, or a rule other than ``"global"`` with a loss whose
            reduction does not divide by the batch size (``"sum"``,
            ``"mean_with_sample_weight"``): naming both ``loss`` and ``loss_denominator``.
    """
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if number and not (0 < float(value) < float("inf")):
        number = False
    if not number and value not in LOSS_DENOMINATORS:
        raise ValueError("loss_denominator must be 'global', 'per_replica' or a positive "
                         f"number (a constant), got {value!r}")  # fmt: skip
    if value != "global" and reduction not in _DIVIDED:
        raise ValueError(
            f"loss_denominator={value!r} with a loss of reduction={reduction!r} is refused: "
            "that reduction does not divide by the batch size, so there is no denominator to "
            "replace; use reduction 'sum_over_batch_size' or loss_denominator='global'"
        )
    return float(value) if number else str(value)


def axis_value(value: str | float) -> str:
    """The capability table's axis value: ``global``, ``constant`` or ``per_replica``."""
    return value if isinstance(value, str) else "constant"


def tower_divisor(value: str | float, divisor: tf.Tensor, shard: Any, towers: int) -> tf.Tensor:
    """What one tower divides its loss sum by under rule ``value``.

    Args:
        value: a checked rule (:func:`check_loss_denominator`).
        divisor: the trainer's global divisor (``TowerTrainer.loss_divisor``).
        shard: the tower's ``(x, y, sample_weight)``.
        towers: the number of towers (the tutorial's ``num_replicas_in_sync``).

    Returns:
        ``divisor`` for ``"global"``; the constant (int32 when it is a whole number, as
        ``compute_average_loss`` takes it); ``shard size × towers`` (int32).
    """
    if value == "global":
        return divisor
    if value == "per_replica":
        size = tf.shape(tf.nest.flatten(shard[0])[0])[0]  # the tutorial's shape_v2(per_ex)[0]
        return size * towers
    constant = float(value)
    if constant.is_integer():
        return tf.constant(int(constant), tf.int32)
    return tf.constant(constant, tf.float32)
