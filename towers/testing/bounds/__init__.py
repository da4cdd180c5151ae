"""Every error bound a comparison holds two runs to, on one rounding model (docs/bounds.md).

Each addition rounds once (``|δ| ≤ u``); a leaf that reaches the root of a summation tree
through at most ``k`` additions (the *summation depth*, ``k ≤ n − 1``) gives
``|ŝ − Σ x_i| ≤ γ_k · Σ |x_i|``, ``γ_k = k·u / (1 − k·u)`` (Higham, *Accuracy and Stability
of Numerical Algorithms*, 2nd ed., Lemma 3.1, §4.2).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.registry import record_of
from towers.allreduce.machinery.rounding import UNIT_ROUNDOFF, gamma, unit_roundoff
from towers.devices import local_devices
from towers.testing.bounds.optimizers import COVERED, update_bounds
from towers.testing.strategies import per_tower_gradients
from towers.testing.values import is_float

__all__ = ["UNIT_ROUNDOFF", "UpdateBound", "exact_sums", "gamma",
           "optimizer_tracker", "resolve_bound", "sgd_step_bound", "sum_bound", "summation_depth",
           "unit_roundoff"]


def summation_depth(algorithm: Any, n: int) -> int:
    """``k`` of ``algorithm`` at ``n`` towers: its record's, else ``n − 1`` (any tree)."""
    record = record_of(algorithm)
    depth = None if record is None else record.summation_depth(n)
    return n - 1 if depth is None else depth


def sum_bound(arrays: Sequence[np.ndarray], op: str, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """``(expected, tolerance)``: the exact reduction of ``arrays`` and the element-wise
    tolerance of a correct result (mean: ``k + 2``; max, min and integers exact)."""
    stack = np.stack(arrays)
    if op in ("max", "min"):
        exact = np.max(stack, axis=0) if op == "max" else np.min(stack, axis=0)
        return exact, np.zeros(exact.shape)
    if not is_float(stack.dtype):
        exact_int = np.asarray(np.sum(stack.astype(object), axis=0), dtype=stack.dtype)
        return exact_int, np.zeros(exact_int.shape)
    wide = stack.astype(np.float64).reshape(len(arrays), -1)
    sums = np.array([math.fsum(column) for column in wide.T], np.float64)
    magnitude = np.sum(np.abs(wide), axis=0)
    n = len(arrays)
    # mean: a division, or a multiply by a rounded 1/n (grappler's rewrite): two more roundings.
    k = depth + 2 * (op == "mean")
    smallest = np.finfo(np.float32 if stack.dtype.name == "bfloat16" else stack.dtype).tiny
    flushed = (k + 1) * float(smallest)  # each rounding may flush a subnormal to zero
    reference = 2 * unit_roundoff("float64")  # fsum, rounded once to float64
    tol = gamma(k, stack.dtype) * magnitude + reference * magnitude + flushed
    if op == "mean":
        sums, tol = sums / n, tol / n + flushed
    shape = arrays[0].shape
    return sums.reshape(shape), tol.reshape(shape)


def sgd_step_bound(weights: Sequence[np.ndarray], grads: list[list[np.ndarray]], lr: float,
                   depth: int) -> list[np.ndarray]:
    """How far two plain-SGD steps summing ``grads[term][var]`` in two orders of depth
    ``depth`` may differ, per weight element (float32)."""
    u = unit_roundoff("float32")
    out = []
    for j, w in enumerate(weights):
        total = np.sum([np.abs(g[j]) for g in grads], axis=0)
        out.append(lr * (2 * gamma(depth) + 4 * u) * total + 4 * u * (np.abs(w) + lr * total))
    return out


def exact_sums(values: Sequence[Sequence[np.ndarray]], depth: int
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per variable, the exact sum over ``values[term][var]`` and its :func:`sum_bound`."""
    pairs = [sum_bound([t[j] for t in values], "sum", depth) for j in range(len(values[0]))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


Tolerances = Callable[[list[np.ndarray], Any, Any], list[np.ndarray]]
"""``(weights before the step, x, y) -> tolerance per weight`` (``model.weights`` order)."""


@dataclasses.dataclass(frozen=True)
class UpdateBound:
    """A bound on one update's difference: ``name`` says which and why."""

    name: str
    tolerances: Tolerances


def optimizer_tracker(optimizer: Any) -> Any:
    """:func:`~towers.testing.bounds.optimizers.update_bounds` for the optimizers it covers,
    else None (the seam for a derived optimizer bound)."""
    return update_bounds(optimizer) if type(optimizer).__name__ in COVERED else None


def _spread(model: Any, weights: list[np.ndarray], tol: Sequence[Any]) -> list[Any]:
    """Per weight: the trainable ones' tolerances, None (not compared) for the others."""
    out: list[Any] = [None] * len(weights)
    trainable = [i for i, v in enumerate(model.weights) if v.trainable]
    for i, t in zip(trainable, tol, strict=True):
        out[i] = np.asarray(t, np.float64)
    return out


def _derived(model: Any, loss: Any, lr: float, tracker: Any) -> UpdateBound:
    """Plain SGD's :func:`sgd_step_bound` (``tracker`` None), or the optimizer's tracked
    bound, over the B per-example gradients (trees of depth ≤ B)."""
    u = unit_roundoff("float32")

    def tolerances(weights: list[np.ndarray], x: Any, y: Any) -> list[np.ndarray]:
        leaves = per_tower_gradients(model, x, y, [local_devices()[0]] * len(x), loss=loss)
        trainable = [w for w, v in zip(weights, model.weights) if v.trainable]
        if tracker is None:
            return _spread(model, weights, sgd_step_bound(trainable, leaves, lr, len(x)))
        exact, tol = exact_sums(leaves, len(x))
        errs = tracker.step(exact, [2 * t for t in tol])  # two summation orders
        return _spread(model, weights, [np.asarray(e) + 4 * u * np.abs(w)
                                        for e, w in zip(errs, trainable)])  # fmt: skip

    if tracker is not None:
        return UpdateBound(f"{type(tracker).__name__} (the optimizer's tracked update bound "
                           "over B per-example gradients, depth ≤ B)", tolerances)  # fmt: skip
    return UpdateBound(f"sgd_step_bound (plain SGD, lr {lr:g}: two steps adding the same B "
                       "per-example gradients in trees of depth ≤ B; towers.testing.bounds "
                       "derives it)", tolerances)  # fmt: skip


def resolve_bound(bound: Any, optimizer: Any, model: Any, loss: Any, argument: str = "bound"
                  ) -> UpdateBound:
    """The :class:`UpdateBound` for ``bound`` as given (a tolerance ≥ 0 or ``(weights, x, y)
    -> tolerances``) or, when None, derived for the teacher's ``optimizer``, ``model`` and
    ``loss``; ValueError (naming ``argument``) when no bound applies."""
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
    plain = type(optimizer) is keras.optimizers.SGD and float(optimizer.momentum) == 0.0
    tracker = None if plain else optimizer_tracker(optimizer)
    if not plain and tracker is None:
        raise ValueError(
            f"{argument}: a derived bound on one update from the same weights exists for "
            f"plain SGD, for {', '.join(COVERED)} (towers.testing.bounds.optimizers) and for two "
            f"towers trainers; got "
            f"{type(optimizer).__name__}: pass bound= (a tolerance or a callable)")
    if model is None or loss is None:
        raise ValueError("bound: sizing the derived bound needs the teacher's model and the "
                         "loss: pass loss=, or steps with model and loss_fn "
                         "(as_step(fn, model, loss=...))")  # fmt: skip
    lr = 0.0 if tracker is not None else float(np.asarray(optimizer.learning_rate))
    return _derived(model, loss, lr, tracker)
