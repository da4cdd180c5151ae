"""The rounding model every error bound in towers builds on: ``u`` per dtype and ``γ_k``.

Each float operation is correctly rounded: ``fl(a ∘ b) = (a ∘ b)(1 + δ)``, ``|δ| ≤ u``, the
dtype's *unit roundoff* (half the gap above 1.0); ``k`` chained roundings stay within
``γ_k = k·u / (1 − k·u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
ed., Lemma 3.1). Defined once, here: codecs, :mod:`towers.guard.reduces` and
:mod:`towers.testing.bounds` build their bounds on them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["UNIT_ROUNDOFF", "gamma", "rounding", "unit_roundoff"]

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
"""``u`` per float dtype name (half the gap above 1.0)."""


def unit_roundoff(dtype: Any) -> float:
    """``u`` of a float dtype (TensorFlow, NumPy or a name); 0 for integers (they are exact)."""
    dtype = tf.as_dtype(dtype)
    return 0.0 if dtype.is_integer else UNIT_ROUNDOFF[dtype.name]


def gamma(k: int, dtype: Any = "float32") -> float:
    """Higham's ``γ_k = k·u / (1 − k·u)``, the relative error of ``k`` chained roundings
    (infinite once ``k·u ≥ 1``)."""
    u = unit_roundoff(dtype)
    return math.inf if k * u >= 1 else k * u / (1.0 - k * u)


def rounding(k: int, abs_sum: Any, dtype: Any = "float32") -> np.ndarray:
    """``γ_k·abs_sum`` in float64: ``k`` roundings of ``dtype``'s unit roundoff."""
    return gamma(k, dtype) * np.asarray(abs_sum, np.float64)
