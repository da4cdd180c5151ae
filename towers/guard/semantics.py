"""``semantics``: what a step computes — one device's result, or MirroredStrategy's.

towers' default, ``"one_device"``, is what one device computes on the whole batch.
Keras 3 under ``MirroredStrategy`` differs from it in five observable ways, and
``"mirrored"`` reproduces all five, so an equivalence test names its reference in one
word::

                          "one_device" (default)            "mirrored"
    non-trainable state   mean over the towers that saw     tower 0's (what reading a
    (BatchNorm moments)   examples: every copy identical    mirrored variable shows)
    loss divisor          the global batch B                the tower's own shard size
                                                            × towers (compute_average_loss
                                                            without global_batch_size)
    gradient clipping     on the reduced gradient, as one   on each tower's share, before
    (clipnorm, clipvalue, device clips the whole gradient   the all-reduce (Keras 3 clips
    global_clipnorm)                                        in the replica's apply)
    order of the sum      tower order                       the strategy's, by the ops'
    (naive,                                                 names (:func:`mirrored_order`)
    parameter_device)
    the update            as written                        under the caller's Grappler
                                                            settings (:func:`strategy_rewrites`)

    batch 10 over 4 towers: shards 3 3 3 1
    "one_device"  every tower ÷ 10
    "mirrored"    ÷ 12   ÷ 12   ÷ 12   ÷ 4      (the last example weighs 3×)

``loss_denominator`` names the divisor apart from the semantics: ``"global"`` (a loop
passing ``global_batch_size``, as ``reference.MirroredTrainer``) or a positive number (an
older tutorial's ``GLOBAL_BATCH_SIZE``). Integer divisors divide as
``compute_average_loss`` does (an int32 size); empty towers never divide by zero.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import callers_rewrites, rewrites
from towers.allreduce.machinery.registry import record_of

__all__ = ["CLIPS", "ORDERED_SUMS", "SEMANTICS", "check_constant", "check_semantics",
           "clip_share", "in_mirrored_order", "mirrored_order", "strategy_rewrites",
           "unclipped"]

SEMANTICS = ("one_device", "mirrored")
"""The values of ``semantics``."""

CLIPS = ("clipnorm", "global_clipnorm", "clipvalue")
"""A Keras optimizer's gradient-clipping hyperparameters."""

_DIVIDED = ("sum_over_batch_size", "mean")
"""Keras reductions whose divisor is the batch size (the ones another divisor replaces)."""


def check_constant(value: Any) -> str | float | None:
    """``loss_denominator`` checked: None, ``"global"`` or a positive finite number."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if number and 0 < float(value) < float("inf"):
        return float(value)
    if value is None or (value == "global" and isinstance(value, str)):
        return value
    raise ValueError("loss_denominator must be None (the semantics' divisor), 'global' or a "
                     f"positive number (a constant), got {value!r}")  # fmt: skip


def check_semantics(semantics: str, divisor: str | float, reduction: str,
                    optimizer: Any) -> None:  # fmt: skip
    """Refuse a divisor the loss has no place for, and clipping under loss scaling.

    Raises:
        ValueError: a mirrored or constant ``divisor`` (the options' rule) with a loss whose
            ``reduction`` does not divide by the batch size, naming both; ``"mirrored"``
            with a ``LossScaleOptimizer`` that clips (it would clip scaled values).
    """
    rule = "semantics='mirrored'" if divisor == "per_replica" else f"loss_denominator={divisor!r}"
    if divisor != "global" and reduction not in _DIVIDED:
        raise ValueError(
            f"{rule} with a loss of reduction={reduction!r} is refused: that reduction does "
            "not divide by the batch size, so there is no divisor to replace; use reduction "
            "'sum_over_batch_size' or loss_denominator='global'")
    inner = getattr(optimizer, "inner_optimizer", None)
    if semantics == "mirrored" and inner is not None and _clips(inner):
        raise ValueError(
            "semantics='mirrored' with a LossScaleOptimizer whose optimizer clips "
            f"({', '.join(k for k in CLIPS if getattr(inner, k, None))}) is refused: each "
            "tower's share is loss-scaled, so clipping it would clip the scaled values; use "
            "semantics='one_device' (clipping the reduced gradient) or no clipping")


def _clips(optimizer: Any) -> bool:
    return any(getattr(optimizer, key, None) for key in CLIPS)


def clip_share(optimizer: Any, grads: list[Any]) -> list[Any]:
    """One tower's gradients clipped by ``optimizer``'s rule (``"mirrored"``: before the
    all-reduce). Keras's own ``_clip_gradients``, so the arithmetic is the optimizer's."""
    if not _clips(optimizer):
        return grads
    return list(optimizer._clip_gradients(list(grads)))


@contextlib.contextmanager
def unclipped(optimizer: Any) -> Iterator[None]:
    """``optimizer`` without its clipping while the block traces an apply: the shares were
    clipped before the all-reduce (``"mirrored"``), so the sum is applied as it is."""
    saved = {key: getattr(optimizer, key, None) for key in CLIPS}
    if not any(saved.values()):
        yield
        return
    for key in CLIPS:
        setattr(optimizer, key, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(optimizer, key, value)


ORDERED_SUMS = ("naive", "parameter_device")
"""The algorithms that add every tower's value in one sum, as ``ReductionToOneDevice``
(MirroredStrategy) and ``CentralStorageStrategy`` do: ``"mirrored"`` adds in their order."""


def mirrored_order(model_name: str, towers: int) -> list[int]:
    """The order MirroredStrategy's sum adds its replicas' gradients in, for a model's name.

    Replica 0's ops are named ``<model>/…``, replica ``i``'s ``replica_<i>/…``, and
    Grappler's arithmetic optimizer sorts an ``AddN``'s inputs by name, so the sum adds
    the replicas in the order of those names (measured on TF 2.21, 2 to 12 replicas)::

        "my_model", 4 towers        0 1 2 3          ("my_model/" sorts first)
        "sequential", 4 towers      1 2 3 0
        "sequential", 12 towers     1 10 11 2 3 4 5 6 7 8 9 0

    Example:
        >>> mirrored_order("sequential", 4)
        [1, 2, 3, 0]
    """
    names = [f"{model_name}/"] + [f"replica_{i}/" for i in range(1, towers)]
    return sorted(range(towers), key=names.__getitem__)


def in_mirrored_order(algorithm: Any, model_name: str, towers: int) -> Any:
    """``algorithm`` adding the towers' values in :func:`mirrored_order` (each output on
    its own tower) when it is one of :data:`ORDERED_SUMS`; else ``algorithm`` itself."""
    record = record_of(algorithm)
    order = mirrored_order(model_name, towers)
    if record is None or record.name not in ORDERED_SUMS or order == sorted(order):
        return algorithm

    def mirrored_sum(values: list[Any], *, op: str = "sum") -> list[Any]:
        outs = algorithm([values[i] for i in order], op=op)
        back: list[Any] = [None] * len(order)
        for k, i in enumerate(order):
            back[i] = outs[k]
        return back

    return mirrored_sum


def strategy_rewrites(apply: Callable[[Any, list[Any]], None]) -> Callable[[Any, list[Any]], None]:
    """``apply(optimizer, grads)`` as a call op Grappler optimizes under the caller's
    settings, as MirroredStrategy's whole step (the sum before it stays as written).

    Grappler rewrites an update's ``x / sqrt(y)`` (RMSprop, Adagrad, …); a call op keeps
    the settings it was made under and, ``_noinline``, is not inlined into the step. Its
    output is used (an ``Assert``), so it keeps a fetch: constant folding pushes a constant
    down (centered RMSprop's ``(v - ḡ²) + ε`` to ``(ε - ḡ²) + v``, as in the strategy's
    step) only in a graph with one; a call whose output nothing reads is specialized
    without it.
    """

    def call(optimizer: Any, grads: list[Any]) -> None:
        def fetched(g: list[Any]) -> tf.Tensor:
            apply(optimizer, g)
            return tf.constant(True)

        function = tf.function(fetched, autograph=False,
                               experimental_attributes={"_noinline": True})  # fmt: skip
        with rewrites(callers_rewrites()):
            tf.debugging.Assert(function(list(grads)), ["the update ran"])  # its fetch, used

    return call
