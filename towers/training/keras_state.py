"""Non-trainable state after a step: every tower's copy combined by its Keras aggregation.

Each tower's forward pass returns new values of the non-trainable variables
(BatchNormalization statistics, seed state, a user's counters); one value per variable
is formed from them by the rule its ``aggregation`` declares (:data:`AGGREGATIONS`), and
the step assigns it to every replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.primitives import send
from towers.allreduce.parameter_device import reduce_on

__all__ = ["AGGREGATIONS", "combine_non_trainable"]


def _unchanged(results: Sequence[Any], j: int) -> bool:
    """No tower changed non-trainable variable ``j`` (known when traced)."""
    return all(r.changed is not None and r.changed[j] is False for r in results)


AGGREGATIONS = ("mean", "none", "sum", "only_first_replica")
"""The rules :func:`combine_non_trainable` combines a variable's towers by, read from its
Keras ``aggregation`` (``keras.Variable(aggregation=...)``, ``add_weight(aggregation=...)``):

=====================  ==================================================================
``mean``, ``none``     floating state (BatchNorm's moving statistics): the mean over the
                       towers that saw examples (an empty tower's copy would drag it back)
``sum``                a running total each tower adds to (a count of examples, a running
                       sum): ``old + Σ_i (new_i − old)``, what one device adds on the whole
                       batch; integer or floating
``only_first_replica`` tower 0's value
``none``, integer      Keras's seed-generator state (advanced alike on every tower): tower
                       0's; any other integer state changed by the towers has no rule (an
                       average of counts is no count) and is refused, naming the variable
=====================  ==================================================================
State no tower changed is kept as it was, bitwise (the mean of ``n`` equal values is not
always that value: ``(x + x + x) / 3``)."""


def _rule(variable: Any, value: tf.Tensor) -> str:
    """The rule of :data:`AGGREGATIONS` for a changed non-trainable ``variable``.

    Raises:
        ValueError: integer state with no declared aggregation (not a seed generator's).
    """
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


def combine_non_trainable(
    results: Sequence[Any], *, first_tower: bool, device: str,
    variables: Sequence[Any] | None = None,
) -> list[tf.Tensor]:
    """One new value per non-trainable variable of ``results`` (every tower's
    :class:`~towers.tower.TowerResult`), formed on ``device``, by the rule of
    :data:`AGGREGATIONS` its ``variables`` entry declares (``variables``: replica 0's
    non-trainable variables, in the results' order; None: every one is ``none``), or tower
    0's for every variable when ``first_tower`` (what MirroredStrategy shows when read).

    Raises:
        ValueError: changed integer state without a declared aggregation (when traced).
    """
    combined = []
    with tf.device(device):
        counts = [send(r.examples, device, note="state") for r in results]
        for j in range(len(results[0].non_trainable)):
            values = [r.non_trainable[j] for r in results]
            if first_tower or _unchanged(results, j):
                combined.append(send(values[0], device, note="state"))
                continue
            rule = "none" if variables is None else _rule(variables[j], values[0])
            if rule == "none":  # no variable to read the rule from: the historical one
                rule = "mean" if values[0].dtype.is_floating else "only_first_replica"
            if rule == "only_first_replica":
                combined.append(send(values[0], device, note="state"))
            elif rule == "sum":
                old = tf.convert_to_tensor(variables[j].value) if variables else values[0]
                deltas = [send(v, device, note="state") - old for v in values]
                combined.append(old + reduce_on(deltas, device, "sum"))
            else:
                masked = [
                    tf.where(c > 0, send(v, device, note="state"), tf.zeros_like(v))
                    for v, c in zip(values, counts)
                ]
                seen = tf.add_n([tf.cast(c > 0, values[0].dtype) for c in counts])
                combined.append(reduce_on(masked, device, "sum") / seen)
    return combined
