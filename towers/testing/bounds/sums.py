"""The sum bound: how far a correct all-reduce (or an SGD step built on one) may be off.

Derivation. Every addition rounds once: ``fl(a + b) = (a + b)(1 + δ)``, ``|δ| ≤ u``
(the unit roundoff, :mod:`towers.allreduce.machinery.rounding`). Sum ``n`` values
``x_i`` in *any* tree (ring, tree, halving-doubling, one device in tower order, …).
Each leaf ``x_i`` reaches the result through the additions on its path to the root,
``d_i`` of them, each contributing one factor ``(1 + δ)``:
``ŝ = Σ x_i·Π_{j ≤ d_i}(1 + δ_j)``. With ``k = max_i d_i``, the *summation depth*,
``|Π(1 + δ_j) − 1| ≤ γ_k = k·u / (1 − k·u)`` (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., Lemma 3.1 and §4.2), so

    |ŝ − Σ x_i| ≤ γ_k · Σ |x_i|.

``k ≤ n − 1`` for every tree of ``n`` leaves, so ``γ_{n−1}`` holds for every correct
algorithm; an algorithm whose record gives ``summation_depth(n)`` is held to its own
``k``. ``mean`` adds two roundings after the sum (a division, or a multiply by a
rounded ``1/n``, which is what Grappler makes of ``x / n``): ``γ_{k+2}·Σ|x_i| / n``.
``max``, ``min`` and integer sums are exact. :func:`sum_bound` adds what the
reference itself costs: it is rounded once to float64 (``2^-52·Σ|x_i|``), and
TensorFlow's CPU kernels flush subnormals to zero, so each of the ``k + 1`` roundings
may lose one smallest normal.

An SGD step ``w − lr·g`` built on two different summation orders (the reference's
and ours) differs by at most ``2γ_k·Σ|g_i|`` in ``g``; the update adds one rounding
of ``lr·g`` (≤ ``u·lr·Σ|g_i|``) and one of the subtraction (≤ ``u·|w'|``) per run;
allowing two of each gives :func:`sgd_step_bound`,
``lr·(2γ_k + 4u)·Σ|g_i| + 4u·(|w| + lr·Σ|g_i|)``.

Per variable, :func:`exact_sums` applies :func:`sum_bound` to every variable of a
step's gradients (``values[term][var]``), and :func:`leaf_bounds` bounds two trees of
different depths over the same per-example gradients (the kernel part of
:mod:`towers.testing.onestep`).

Example:
    >>> float(gamma_exact(1, "float32")) == 2.0**-24 / (1 - 2.0**-24)
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from towers.allreduce.machinery.rounding import gamma, unit_roundoff

__all__ = ["exact_sums", "gamma_exact", "leaf_bounds", "sgd_step_bound", "sum_bound"]


def gamma_exact(k: int, dtype: Any = "float32") -> Fraction:
    """:func:`gamma` as an exact fraction, for checks in exact arithmetic."""
    u = Fraction(unit_roundoff(dtype))
    return k * u / (1 - k * u)


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"  # ml_dtypes' bfloat16 has kind "V"


def sum_bound(
    arrays: Sequence[np.ndarray], op: str, depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """The exact reduction of ``arrays`` and the element-wise tolerance of a correct result.

    Floats: the sum rounded once to float64 (``math.fsum``) and ``γ_k·Σ|x_i|`` with
    ``k = depth`` (+2 for ``mean``), plus the reference's own rounding and flushed
    subnormals (see the module docstring). ``max``, ``min`` and integers: exact, zero
    tolerance.

    Returns:
        ``(expected, tolerance)``, both of the arrays' shape.
    """
    stack = np.stack(arrays)
    if op in ("max", "min"):
        exact = np.max(stack, axis=0) if op == "max" else np.min(stack, axis=0)
        return exact, np.zeros(exact.shape)
    if not _is_float(stack.dtype):
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


def sgd_step_bound(
    weights: Sequence[np.ndarray], grads: list[list[np.ndarray]], lr: float, depth: int
) -> list[np.ndarray]:
    """Largest difference between two plain-SGD steps that sum the same tower gradients
    in different orders, per weight element (float32; derived in the module docstring).

    Args:
        weights: the weights before the step.
        grads: ``grads[tower][var]``, each tower's gradient.
        lr: the learning rate.
        depth: the larger summation depth of the two orders.

    Returns:
        ``lr·(2γ_depth + 4u)·Σ|g_i| + 4u·(|w| + lr·Σ|g_i|)`` per weight.
    """
    u = unit_roundoff("float32")
    out = []
    for j, w in enumerate(weights):
        total = np.sum([np.abs(g[j]) for g in grads], axis=0)
        out.append(lr * (2 * gamma(depth) + 4 * u) * total + 4 * u * (np.abs(w) + lr * total))
    return out


def exact_sums(
    values: Sequence[Sequence[np.ndarray]], depth: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per variable, the exact sum over ``values[term][var]`` and its depth-``depth`` bound
    (:func:`sum_bound` with ``op="sum"``)."""
    pairs = [sum_bound([t[j] for t in values], "sum", depth) for j in range(len(values[0]))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def leaf_bounds(leaves: list[list[np.ndarray]], depth_a: int, depth_b: int) -> list[np.ndarray]:
    """Per variable, how far two trees of depths ``depth_a`` and ``depth_b`` over the same
    per-example ``leaves[e][var]`` may differ: the two trees' bounds added."""
    bounds_a, bounds_b = exact_sums(leaves, depth_a)[1], exact_sums(leaves, depth_b)[1]
    return [a + b for a, b in zip(bounds_a, bounds_b, strict=True)]
