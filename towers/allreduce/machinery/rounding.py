"""The rounding model every error bound in towers is built on: ``u`` per dtype and ``γ_k``.

Floating-point arithmetic is correctly rounded: ``fl(a ∘ b) = (a ∘ b)(1 + δ)`` with
``|δ| ≤ u``, the *unit roundoff* of the dtype (half the gap above 1.0)::

    float16   2^-11        bfloat16   2^-8        float32   2^-24        float64   2^-53

A value that passes through ``k`` roundings is multiplied by ``Π(1 + δ_j)``, and
``|Π(1 + δ_j) − 1| ≤ γ_k = k·u / (1 − k·u)`` (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., Lemma 3.1): a sum of depth ``k`` lies within
``γ_k·Σ|x_i|`` of the exact one.

They are defined here, once, because the library bounds with them itself (each codec's
``error_bound``, the check of a user's algorithm in :mod:`towers.guard.reduces`); every
bound a test holds a step to builds on them in :mod:`towers.testing.bounds`, and
:mod:`towers.testing` exports both.

Example:
    >>> gamma(3, "float32") == 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    True
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

__all__ = ["UNIT_ROUNDOFF", "gamma", "unit_roundoff"]

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
