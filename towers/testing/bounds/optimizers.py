"""How a bounded gradient difference moves through one optimizer step and its slots.

Keras 3's update formulas are evaluated on an :class:`Interval` per slot element (interval
arithmetic: the set two runs' float values lie in), each rounding widened by ``u·|x|`` plus
one flushed subnormal (docs/bounds.md §2). An argument used twice is over-estimated (the
dependency problem): :func:`pieces` cuts it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.rounding import unit_roundoff

__all__ = ["BOUNDED", "COVERED", "PIECES", "TINY", "ZERO_GRADIENT_NOISE", "Interval",
           "UpdateBounds", "pieces", "update_bounds"]

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
        center, radius = np.asarray(center, np.float64), np.abs(np.asarray(radius, np.float64))
        return cls(center - radius, center + radius)

    @property
    def magnitude(self) -> np.ndarray:
        """The largest absolute value inside."""
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
        return Interval(np.maximum(self.lo, other.lo), np.maximum(self.hi, other.hi))

    def clip(self, cap: float | np.ndarray) -> Interval:
        """Intersect with ``[−cap, cap]``: a bound each run's value is known to obey."""
        return Interval(np.clip(self.lo, -cap, cap), np.clip(self.hi, -cap, cap))

    def at_least(self, floor: float) -> Interval:
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


PIECES = 16  # pieces a gradient interval is cut into: the over-estimate shrinks as 1/PIECES
BOUNDED = "bounded"
ZERO_GRADIENT_NOISE = "zero-gradient noise"
U = unit_roundoff("float32")
SAFETY = 1.0 + 2.0**-10  # Keras' float32 constants (1 − β₂ᵗ …) are up to an ULP off ours
_REFUSED = ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor",
            "gradient_accumulation_steps", "ema_overwrite_frequency")  # fmt: skip
_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adam_w": "AdamW",
            "nadam": "Nadam", "rmsprop": "RMSprop", "rm_sprop": "RMSprop"}  # fmt: skip

Slots = dict[str, Interval]
Rule = Callable[[Interval, Slots, Mapping[str, Any], int], tuple[Interval, Slots]]


def _f32(x: float) -> float:
    return float(np.float32(x))


def _sgd(g: Interval, slots: Slots, c: Mapping[str, Any], t: int) -> tuple[Interval, Slots]:
    lr, beta = c["learning_rate"], _f32(c["momentum"])
    if beta == 0:
        return (g * lr).rounded(1, U), {}
    m = (slots["m"] * beta - g * lr).rounded(3, U)  # m·β − g·lr
    return ((m * beta - g * lr).rounded(3, U) if c["nesterov"] else m), {"m": m}


def _moments(g: Interval, slots: Slots, beta_1: float, beta_2: float) -> Slots:
    """Adam's and Nadam's ``m + (g − m)(1 − β₁)`` and ``v + (g² − v)(1 − β₂)`` (each
    argument once: ``m·β₁' + g·(1 − β₁)``, exact images), 3 and 4 roundings."""
    c1, c2 = _f32(1 - beta_1), _f32(1 - beta_2)
    m = (slots["m"] * (1 - c1) + g * c1).rounded(3, U)
    v = (slots["v"] * (1 - c2) + g.square() * c2).rounded(4, U).at_least(0.0)
    return {"m": m, "v": v}


def _adam_cap(beta_1: float, beta_2: float, t: int) -> float:
    """``max |m_t| / √v_t`` over every gradient history from zero slots (Cauchy–Schwarz)."""
    q = beta_1**2 / beta_2
    history = t if q == 1 else (1 - q**t) / (1 - q)
    return (1 - beta_1) / math.sqrt(1 - beta_2) * math.sqrt(history) * (1 + 16 * U)


def _adam(g: Interval, slots: Slots, c: Mapping[str, Any], t: int) -> tuple[Interval, Slots]:
    b1, b2 = _f32(c["beta_1"]), _f32(c["beta_2"])
    new = _moments(g, slots, b1, b2)
    v = new["v"]
    if c.get("amsgrad"):
        v = new["v_hat"] = slots["v_hat"].maximum(v)
    alpha = c["learning_rate"] * math.sqrt(1 - b2**t) / (1 - b1**t)
    move = (new["m"] * alpha / (v.sqrt() + c["epsilon"])).rounded(5, U)
    return move.clip(alpha * _adam_cap(b1, b2, t)), new


def _nadam(g: Interval, slots: Slots, c: Mapping[str, Any], t: int) -> tuple[Interval, Slots]:
    b1, b2, lr = _f32(c["beta_1"]), _f32(c["beta_2"]), c["learning_rate"]
    u_t, u_next = (b1 * (1 - 0.5 * 0.96**s) for s in (t, t + 1))
    product = math.prod(b1 * (1 - 0.5 * 0.96**s) for s in range(1, t + 1))
    a, b = u_next / (1 - product * u_next), (1 - u_t) / (1 - product)
    new = _moments(g, slots, b1, b2)
    m_hat = ((new["m"] * a).rounded(2, U) + (g * b).rounded(2, U)).rounded(1, U)
    v_hat = (new["v"] / (1 - b2**t)).rounded(1, U)
    move = (m_hat * lr / (v_hat.sqrt() + c["epsilon"])).rounded(5, U)
    # |m| ≤ C·√v and |g| ≤ √(v / (1 − β₂)): the largest step either run can take
    cap = lr * math.sqrt(1 - b2**t) * (a * _adam_cap(b1, b2, t) + b / math.sqrt(1 - b2))
    return move.clip(cap * (1 + 16 * U)), new


def _rmsprop(g: Interval, slots: Slots, c: Mapping[str, Any], t: int) -> tuple[Interval, Slots]:
    rho, lr, mu = c["rho"], c["learning_rate"], c["momentum"]
    v = (slots["v"] * _f32(rho) + g.square() * _f32(1 - rho)).rounded(4, U).at_least(0.0)
    step = ((g * lr) / (v + c["epsilon"]).sqrt()).rounded(5, U)
    step = step.clip(lr / math.sqrt(1 - rho) * (1 + 16 * U))  # v ≥ (1 − ρ)·g²
    if mu <= 0:
        return step, {"v": v}
    m = (slots["m"] * _f32(mu) + step).rounded(2, U)
    return m, {"v": v, "m": m}


def _adam_slots(c: Mapping[str, Any]) -> tuple[str, ...]:
    return ("m", "v", "v_hat") if c.get("amsgrad") else ("m", "v")


_RULES: dict[str, tuple[Rule, Callable[[Mapping[str, Any]], tuple[str, ...]]]] = {
    "SGD": (_sgd, lambda c: ("m",) if c["momentum"] else ()),  # (rule, its slots for a config)
    "Adam": (_adam, _adam_slots),
    "AdamW": (_adam, _adam_slots),
    "Nadam": (_nadam, lambda c: ("m", "v")),
    "RMSprop": (_rmsprop, lambda c: ("v", "m") if c["momentum"] > 0 else ("v",)),
}


class UpdateBounds:
    """The per-step bound of one optimizer (``name``, its ``config``); ``kinds`` names each
    variable of the last step :data:`BOUNDED` or :data:`ZERO_GRADIENT_NOISE`."""

    def __init__(self, name: str, config: Mapping[str, Any]) -> None:
        self.name, self.config = name, dict(config)
        self.rule, self._slot_names = _RULES[name]
        self.steps = 0
        self.kinds: list[str] = []
        self._slots: tuple[list[Slots], list[Slots]] | None = None  # run a's, run b's

    def _image(self, grad: Interval, count: int, slots: Slots) -> tuple[Interval, Slots]:
        """The rule's image of a gradient interval cut into ``count`` pieces, joined."""
        move, new = self.rule(pieces(grad, count), slots, self.config, self.steps)
        return move.union(), {name: value.union() for name, value in new.items()}

    def step(self, grads: Sequence[np.ndarray], grad_errors: Sequence[np.ndarray],
             weights: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Bound ``|Δ_a − Δ_b|`` for this step, per variable and element, and carry the slots.

        ``grads``: run a's gradient per variable; ``grad_errors``: element-wise bounds on
        ``|g_a − g_b|``; ``weights`` (optional, where both start): the bound then covers
        the new weights (``u·|w'|`` per run for the assignment) instead of the movement.
        """
        g, e = _check_pairs(grads, grad_errors, weights)
        if self._slots is None:
            zero = [{s: Interval(np.zeros_like(x), np.zeros_like(x))
                     for s in self._slot_names(self.config)} for x in g]  # fmt: skip
            self._slots = (zero, [dict(s) for s in zero])
        self.steps += 1
        out, slots_a, slots_b = [], [], []
        for j, (grad, err) in enumerate(zip(g, e)):
            # run a (the given gradient) alone, and any b within the error of it
            move_a, new_a = self._image(Interval(grad, grad), 1, self._slots[0][j])
            move_b, new_b = self._image(Interval.around(grad, err), PIECES, self._slots[1][j])
            slots_a.append(new_a)
            slots_b.append(new_b)
            bound = np.maximum(move_b.hi - move_a.lo, move_a.hi - move_b.lo) * SAFETY
            if weights is not None:
                wd = (self.config.get("weight_decay") or 0.0) * self.config["learning_rate"]
                moved = np.abs(np.asarray(weights[j], np.float64)) * (1 + wd) + move_b.magnitude
                bound = bound + 2 * (U * moved + TINY)
            out.append(bound)
        self._slots = (slots_a, slots_b)
        # zero-gradient noise: every element's gradient is within its error of zero
        self.kinds = [ZERO_GRADIENT_NOISE if np.all(np.abs(grad) <= err) and err.any()
                      else BOUNDED for grad, err in zip(g, e)]  # fmt: skip
        return out


def _check_pairs(grads: Sequence[np.ndarray], errors: Sequence[np.ndarray],
                 weights: Sequence[np.ndarray] | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    g = [np.asarray(x, np.float64) for x in grads]
    e = [np.asarray(x, np.float64) for x in errors]
    if len(g) != len(e) or (weights is not None and len(weights) != len(g)):
        raise ValueError(f"grads and grad_errors (and weights) must have one array per "
                         f"variable, got {len(g)} and {len(e)}")  # fmt: skip
    for j, (x, err) in enumerate(zip(g, e)):
        if x.shape != err.shape or (weights is not None and np.shape(weights[j]) != x.shape):
            raise ValueError(f"grad_errors[{j}] must have grads[{j}]'s shape {x.shape}, "
                             f"got {err.shape}")  # fmt: skip
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(err))):
            raise ValueError(f"grads[{j}] and grad_errors[{j}] must be finite")
        if np.any(err < 0):
            raise ValueError(f"grad_errors[{j}] must be >= 0, got {err.min()}")
    return g, e


COVERED = tuple(_RULES)  # the Keras optimizer classes update_bounds bounds


def update_bounds(optimizer: Any) -> UpdateBounds:
    """A fresh per-step bound tracker for a Keras optimizer that has not stepped (or its
    ``get_config()`` / ``keras.optimizers.serialize`` dict); ValueError for what it cannot
    bound (a class, option, schedule)."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if int(optimizer.iterations.numpy()) != 0:
            raise ValueError(f"update_bounds needs an optimizer that has not stepped, got "
                             f"iterations={int(optimizer.iterations.numpy())}")
        name, config = type(optimizer).__name__, optimizer.get_config()
    elif not isinstance(optimizer, Mapping):
        raise ValueError(f"optimizer must be a Keras optimizer or its config dict, got "
                         f"{type(optimizer).__name__}")
    elif "class_name" in optimizer:  # keras.optimizers.serialize
        name, config = str(optimizer["class_name"]), dict(optimizer.get("config", {}))
    else:
        config = dict(optimizer)
        # Keras numbers a repeated default name: "nadam_8"
        name = _CLASSES.get(re.sub(r"_\d+$", "", str(config.get("name", "")).lower()), "")
    if name not in _RULES:
        raise ValueError(f"update_bounds bounds {', '.join(_RULES)} (a config by its class_name "
                         f"or default name), got {name or repr(config.get('name'))}")
    for option in _REFUSED:
        if config.get(option) is not None:
            raise ValueError(f"update_bounds cannot bound an optimizer with {option}="
                             f"{config[option]!r}; expected {option}=None")  # fmt: skip
    for option in ("use_ema", "centered"):  # only RMSprop has centered
        if config.get(option):
            raise ValueError(f"update_bounds cannot bound {name} with {option}=True")
    lr = config.get("learning_rate")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ValueError(f"update_bounds needs a float learning_rate (not a schedule), got {lr!r}")
    return UpdateBounds(name, config)
