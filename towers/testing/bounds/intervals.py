"""Element-wise interval arithmetic with rounding: the sets two runs' float values lie in.

An argument used twice is over-estimated (the dependency problem): :func:`pieces` cuts it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["TINY", "Interval", "pieces"]

TINY = float(np.finfo(np.float32).tiny)  # what one flushed subnormal may lose


def _as_interval(x: Interval | float) -> Interval:
    return x if isinstance(x, Interval) else Interval(np.float64(x), np.float64(x))


@dataclasses.dataclass(frozen=True)
class Interval:
    """``[lo, hi]`` element-wise, holding the value each of two runs computes (float64)."""

    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def around(cls, center: np.ndarray, radius: np.ndarray) -> Interval:
        """``[center − radius, center + radius]``."""
        center, radius = np.asarray(center, np.float64), np.abs(np.asarray(radius, np.float64))
        return cls(center - radius, center + radius)

    @property
    def magnitude(self) -> np.ndarray:
        """``max(|lo|, |hi|)``: the largest absolute value inside."""
        return np.maximum(np.abs(self.lo), np.abs(self.hi))

    def __add__(self, other: Interval | float) -> Interval:
        other = _as_interval(other)
        return Interval(self.lo + other.lo, self.hi + other.hi)

    def __sub__(self, other: Interval | float) -> Interval:
        other = _as_interval(other)
        return Interval(self.lo - other.hi, self.hi - other.lo)

    def __mul__(self, other: Interval | float) -> Interval:
        other = _as_interval(other)
        corners = np.stack(np.broadcast_arrays(
            self.lo * other.lo, self.lo * other.hi, self.hi * other.lo, self.hi * other.hi))
        return Interval(corners.min(axis=0), corners.max(axis=0))

    def __truediv__(self, other: Interval | float) -> Interval:
        """Division by an interval that excludes 0 (every divisor here is positive)."""
        other = _as_interval(other)
        if np.any((other.lo <= 0) & (other.hi >= 0)):
            raise ValueError("an interval divisor must exclude 0")
        return self * Interval(1.0 / other.hi, 1.0 / other.lo)

    def square(self) -> Interval:
        """``x²`` of one argument (0 when the interval holds 0, not ``lo·hi < 0``)."""
        low, high = self.lo**2, self.hi**2
        straddles = (self.lo <= 0) & (self.hi >= 0)
        return Interval(np.where(straddles, 0.0, np.minimum(low, high)), np.maximum(low, high))

    def sqrt(self) -> Interval:
        """``√x`` of a non-negative quantity (a rounding below 0 is read as 0)."""
        return Interval(np.sqrt(np.maximum(self.lo, 0.0)), np.sqrt(np.maximum(self.hi, 0.0)))

    def maximum(self, other: Interval) -> Interval:
        """Element-wise ``max`` (AMSGrad's running maximum)."""
        return Interval(np.maximum(self.lo, other.lo), np.maximum(self.hi, other.hi))

    def clip(self, cap: float | np.ndarray) -> Interval:
        """Intersect with ``[−cap, cap]``: a bound each run's value is known to obey."""
        return Interval(np.clip(self.lo, -cap, cap), np.clip(self.hi, -cap, cap))

    def at_least(self, floor: float) -> Interval:
        """Intersect with ``[floor, ∞)`` (a quantity known to be non-negative)."""
        return Interval(np.maximum(self.lo, floor), np.maximum(self.hi, floor))

    def rounded(self, roundings: int, u: float) -> Interval:
        """Widen by what ``roundings`` float roundings of unit roundoff ``u`` may add, each
        relative to the largest value (``u·|x|``) plus one flushed subnormal."""
        slack = roundings * (u * self.magnitude + TINY)
        return Interval(self.lo - slack, self.hi + slack)

    def union(self, axis: int = 0) -> Interval:
        """The hull of the intervals stacked along ``axis`` (the pieces of :func:`pieces`)."""
        return Interval(self.lo.min(axis=axis), self.hi.max(axis=axis))


def pieces(x: Interval, count: int) -> Interval:
    """``x`` cut into ``count`` equal sub-intervals, stacked along a new axis 0."""
    steps = np.arange(count + 1, dtype=np.float64).reshape((-1,) + (1,) * np.ndim(x.lo)) / count
    edges = x.lo + steps * (x.hi - x.lo)
    return Interval(edges[:-1], edges[1:])
