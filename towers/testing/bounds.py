"""The one error bound: how far a correct all-reduce (or an SGD step built on one) may be off.

Derivation. Floating-point addition is correctly rounded: ``fl(a + b) = (a + b)(1 + δ)``
with ``|δ| ≤ u``, the unit roundoff of the dtype (half the gap above 1.0):

    =========  ========  ==========================================
    float16    2^-11     bfloat16  2^-8
    float32    2^-24     float64   2^-53
    =========  ========  ==========================================

Sum ``n`` values ``x_i`` in *any* tree (ring, tree, halving-doubling, one device in
tower order, …). Each leaf ``x_i`` reaches the result through the additions on its
path to the root, ``d_i`` of them, each contributing one factor ``(1 + δ)``:
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

Example:
    >>> gamma(3, "float32") == 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = [
    "UNIT_ROUNDOFF",
    "gamma",
    "gamma_exact",
    "sgd_step_bound",
    "sum_bound",
    "unit_roundoff",
]

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
"""``u`` per float dtype name (half the gap above 1.0)."""


def unit_roundoff(dtype: Any) -> float:
    """``u`` of a float dtype (TensorFlow, NumPy or a name); 0 for integers (they are exact).

    Example:
        >>> unit_roundoff("float32") == 2.0**-24
        True
    """
    dtype = tf.as_dtype(dtype)
    return 0.0 if dtype.is_integer else UNIT_ROUNDOFF[dtype.name]


def gamma(k: int, dtype: Any = "float32") -> float:
    """Higham's ``γ_k = k·u / (1 − k·u)``: the relative error of ``k`` chained roundings.

    Infinite once ``k·u ≥ 1`` (no bound left).
    """
    u = unit_roundoff(dtype)
    return math.inf if k * u >= 1 else k * u / (1.0 - k * u)


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
    tol = gamma(k, stack.dtype) * magnitude + 2.0**-52 * magnitude + flushed  # float64 reference
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
    u = UNIT_ROUNDOFF["float32"]
    out = []
    for j, w in enumerate(weights):
        total = np.sum([np.abs(g[j]) for g in grads], axis=0)
        out.append(lr * (2 * gamma(depth) + 4 * u) * total + 4 * u * (np.abs(w) + lr * total))
    return out
