"""``bisect``: the first step, variable and element where two configurations part.

Two configurations (a towers trainer with algorithm A against one with algorithm B,
or a towers trainer against a ``tf.distribute`` reference from ``reference/``) train
on the same batches from the same weights. Run A is the teacher: before every step
run B is set to A's weights, so each step is checked on its own, as a one-step bound
(:mod:`towers.testing.onestep`)::

    step:      1        2        3        4   …
    A (free)   W1 ────▶ W2 ────▶ W3 ────▶ W4
               │set     │set     │set
    B          G1'      G2'      G3'  ✗       first step outside the bound
                                  │
                                  ├─ first variable in model order outside it
                                  └─ first element outside it: its chunk k of m
                                     (elements lo..hi) under B's pad_split into
                                     n·subchunks pieces, both values, |Δ|, bound

Because every step starts from the same weights, the steps are independent and an
in-order scan finds the first bad one exactly (a binary search over free-running
runs would find where trajectories part, which rounding alone makes happen).

Two towers trainers are compared on their reduced gradients (the step's public
phases ``split → forward_backward → reduce``, run eagerly). Any other step exposes
no gradient, so the comparison is the update of one step from the same weights,
held to the bound :mod:`towers.testing.bounds.update` picks and names: plain SGD's
:func:`towers.testing.sgd_step_bound` (the tower gradients as the summed terms), a
``bound=`` given, or an optimizer's tracked bound; otherwise it is refused. A towers
side always runs its phases eagerly, so a stateful reduction (one that counts its
calls) is called once per variable per step, in model order, in both modes. The
machinery is :mod:`towers.testing.compare`'s; ``bisect`` stops at the first step
outside.

Example:
    >>> report = bisect("ring", "mirrored", batches, model_fn=make_model,
    ...                 optimizer_fn=lambda: keras.optimizers.SGD(0.1),
    ...                 loss="sparse_categorical_crossentropy")    # doctest: +SKIP
    >>> report.first                                               # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import keras

from towers.testing.compare import run_comparison
from towers.testing.report import BisectReport

__all__ = ["bisect"]


def bisect(
    config_a: Any,
    config_b: Any,
    batches: Iterable[Any],
    *,
    model_fn: Callable[[], keras.Model] | None = None,
    optimizer_fn: Callable[[], keras.optimizers.Optimizer] | None = None,
    loss: Any = None,
    towers: int | None = None,
    steps: int | None = None,
    bound: Any = None,
) -> BisectReport:
    """Find the first step, variable and element where B leaves A's bound.

    Args:
        config_a: the teacher: a step (``TowerTrainer``, a reference trainer,
            ``as_step(fn, model)``) or a configuration: a :class:`~towers.testing.compare.Config`,
            an algorithm name, ``"towers:NAME"``, ``"mirrored"``, ``"central_storage"``
            or an all-reduce callable.
        config_b: the step or configuration under test, the same kinds.
        batches: ``(x, y)`` global batches.
        model_fn: a zero-argument factory of a built ``keras.Model`` (configurations).
        optimizer_fn: a zero-argument factory of a Keras optimizer (configurations;
            plain SGD when a side is a reference, unless ``bound`` is given).
        loss: a Keras loss, a loss name or ``(y_true, y_pred) -> per-example losses``.
        towers: the tower count (configurations: default 4; steps: their own).
        steps: how many batches to check at most (default: all).
        bound: None (derived), a tolerance, or ``(weights, x, y) -> tolerances``
            (:mod:`towers.testing.bounds.update`).

    Returns:
        A :class:`~towers.testing.report.BisectReport`; ``report.first`` is the
        :class:`~towers.testing.report.Divergence` or None; ``report.bound`` the bound used.

    Raises:
        ValueError: bad configurations, tower count, batches or steps; an optimizer
            with no derived bound and no ``bound=``.
    """
    return run_comparison(config_a, config_b, batches, stop=True, bound=bound, loss=loss,
                          towers=towers, steps=steps, model_fn=model_fn,
                          optimizer_fn=optimizer_fn)  # fmt: skip
