"""Which bound holds one teacher-forced update of two steps, and why that one.

Two steps that expose no gradient (a ``tf.distribute`` loop, a user's step) are
compared on their weights after one update from the same weights. What bounds the
difference depends on the optimizer, and the report names the choice::

    bound=            a number: |Δ| ≤ it everywhere    a callable: bound(weights, x, y)
    None, plain SGD   sgd_step_bound(w, c_examples, lr, B): two steps that add the same
                      B per-example gradients c_e in any two trees (towers.testing.bounds.sums)
    None, other       an optimizer's tracked bound, where one is known
                      (:func:`optimizer_tracker`); otherwise refused: pass bound=

Two ``TowerTrainer`` s never come here: they are compared on their reduced gradients
under the derived reduction bound (:mod:`towers.testing.onestep`).

Why per-example leaves and not the towers' gradients: two different steps need not
form the same tower gradients (a user's one-device step adds all B examples in one
kernel; towers adds a shard's in each tower, then across towers). Each is a tree
over the per-example gradients ``c_e`` (depth ≤ B − 1 additions, plus the product
inside a leaf), so ``sgd_step_bound`` with the leaves ``c_e`` and depth B holds for
any two of them — provided each example's own values are computed alike at every
batch size (row-wise kernels; oneDNN's MatMul blocks by batch size, see
:mod:`towers.testing.onestep`). Measured: a correct one-device step against a
one-tower ``TowerTrainer`` differs by 7.4e-10 on a bias whose tower gradient cancels
(the tower-gradient bound there is 3.1e-11; this one holds).

The tracked bound is the seam for optimizers with slots (momentum, Adam, RMSprop):
a tracker is made once per comparison, ``tracker.step(grads, grad_errors)`` takes the
exact reduced gradient and its error bound per variable and returns the update's error
bound per variable (its slots carry earlier errors forward, and it counts the update
term's own roundings); the subtraction ``w − Δw`` of each run is added here as ``4u·|w|``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.rounding import unit_roundoff
from towers.devices import local_devices
from towers.testing.bounds.optimizers import COVERED, update_bounds
from towers.testing.bounds.sums import exact_sums, sgd_step_bound
from towers.testing.onestep import example_gradients

__all__ = ["UpdateBound", "optimizer_tracker", "resolve_bound"]

Tolerances = Callable[[list[np.ndarray], Any, Any], list[np.ndarray]]
"""``(weights before the step, x, y) -> tolerance per weight`` (``model.weights`` order)."""


@dataclasses.dataclass(frozen=True)
class UpdateBound:
    """A bound on one update's difference: its name, why it applies, and its values.

    Attributes:
        name: what the report prints (``"sgd_step_bound (…)"``, ``"tolerance 1e-06"``).
        tolerances: ``(weights, x, y) -> [tolerance per weight]``.
    """

    name: str
    tolerances: Tolerances


def optimizer_tracker(optimizer: Any) -> Any:
    """A tracker of ``optimizer``'s update error (``tracker.step(grads, grad_errors)``), or
    None where no derived bound is known: :func:`towers.testing.bounds.optimizers.update_bounds`
    for the optimizers it covers (SGD with momentum or Nesterov, Adam, AdamW, Nadam,
    RMSprop; docs/bounds.md).

    Raises:
        ValueError: a covered optimizer with an option the bound does not cover (clipping,
            EMA, a learning-rate schedule, slots that already stepped), naming it.
    """
    if type(optimizer).__name__ not in COVERED:
        return None
    return update_bounds(optimizer)


def _plain_sgd(optimizer: Any) -> bool:
    return type(optimizer) is keras.optimizers.SGD and float(optimizer.momentum) == 0.0


def _leaves(model: Any, loss: Any) -> Callable[[Any, Any], Any]:
    """``(x, y) -> leaves[e][var]``: each example's gradient of its share of the mean loss."""
    device = local_devices()[0]
    return lambda x, y: example_gradients(model, loss, x, y, device)


def _sgd(model: Any, loss: Any, lr: float) -> UpdateBound:
    leaves_of = _leaves(model, loss)

    def tolerances(weights: list[np.ndarray], x: Any, y: Any) -> list[np.ndarray]:
        trainable = _trainable_positions(model)
        tol = sgd_step_bound([weights[i] for i in trainable], leaves_of(x, y), lr, len(x))
        return _spread(weights, trainable, tol)

    why = (f"sgd_step_bound (plain SGD, lr {lr:g}: two steps adding the same B per-example "
           "gradients in trees of depth ≤ B; towers.testing.bounds.sums derives it)")  # fmt: skip
    return UpdateBound(why, tolerances)


def _tracked(model: Any, loss: Any, tracker: Any) -> UpdateBound:
    leaves_of, u = _leaves(model, loss), unit_roundoff("float32")

    def tolerances(weights: list[np.ndarray], x: Any, y: Any) -> list[np.ndarray]:
        trainable = _trainable_positions(model)
        exact, tol = exact_sums(leaves_of(x, y), len(x))
        errs = tracker.step(exact, [2 * t for t in tol])  # two summation orders
        tol = [np.asarray(e) + 4 * u * np.abs(weights[i]) for e, i in zip(errs, trainable)]
        return _spread(weights, trainable, tol)

    name = (f"{type(tracker).__name__} (the optimizer's tracked update bound over B "
            "per-example gradients, depth ≤ B)")  # fmt: skip
    return UpdateBound(name, tolerances)


def _trainable_positions(model: Any) -> list[int]:
    return [i for i, v in enumerate(model.weights) if v.trainable]


def _spread(weights: list[np.ndarray], trainable: list[int], tol: Sequence[Any]) -> list[Any]:
    """Per weight: the trainable ones' tolerances, None (not compared) for the others."""
    out: list[Any] = [None] * len(weights)
    for i, t in zip(trainable, tol, strict=True):
        out[i] = np.asarray(t, np.float64)
    return out


def resolve_bound(
    bound: Any, optimizer: Any, model: Any, loss: Any, argument: str = "bound"
) -> UpdateBound:
    """The :class:`UpdateBound` for ``bound`` (as given) or for ``optimizer``.

    Args:
        bound: None, a tolerance (a number ≥ 0) or ``(weights, x, y) -> tolerances``.
        optimizer, model, loss: the teacher step's (sizing a derived bound).
        argument: the argument to name when no bound applies.

    Raises:
        ValueError: a negative or non-finite tolerance; no ``bound`` and an optimizer
            without a derived bound; a derived bound without a model or loss.
    """
    if isinstance(bound, numbers.Real) and not isinstance(bound, bool):
        if not 0 <= float(bound) < float("inf"):
            raise ValueError(f"bound must be a tolerance >= 0 or a callable, got {bound!r}")
        tol = float(bound)
        return UpdateBound(f"tolerance {tol:g} (given as bound=)",
                           lambda w, x, y: [np.full(a.shape, tol) for a in w])  # fmt: skip
    if callable(bound):
        name = getattr(bound, "__name__", type(bound).__name__)
        return UpdateBound(f"{name} (given as bound=)", bound)
    if bound is not None:
        raise ValueError(f"bound must be None, a tolerance >= 0 or a callable, got {bound!r}")
    tracker = None if _plain_sgd(optimizer) else optimizer_tracker(optimizer)
    if not _plain_sgd(optimizer) and tracker is None:
        raise ValueError(
            f"{argument}: a derived bound on one update from the same weights exists for "
            f"plain SGD, for {', '.join(COVERED)} (towers.testing.bounds.optimizers) and for two "
            f"towers trainers; got "
            f"{type(optimizer).__name__}: pass bound= (a tolerance or a callable)")
    if model is None or loss is None:
        raise ValueError("bound: sizing the derived bound needs the teacher's model and the "
                         "loss: pass loss=, or steps with model and loss_fn "
                         "(as_step(fn, model, loss=...))")  # fmt: skip
    if tracker is not None:
        return _tracked(model, loss, tracker)
    return _sgd(model, loss, float(np.asarray(optimizer.learning_rate)))
