"""Argument checks, written once: each returns the value it checked or raises naming it,
``"<name> must be <what was expected>, got <value>"`` (a ``ValueError``).

Example:
    >>> positive_int("chunks", 4), optional(positive_int, "keep", None)
    (4, None)
    >>> positive_int("chunks", 0)
    Traceback (most recent call last):
    ValueError: chunks must be an int >= 1, got 0
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["check_bool", "check_choice", "int_at_least", "naming", "non_negative_float",
           "non_negative_int", "optional", "positive_float", "positive_int"]

T = TypeVar("T")


def int_at_least(name: str, value: Any, low: int) -> int:
    """``value`` as an ``int`` when it is an integer ``>= low`` (not a bool nor ``2.0``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int >= 1`` (a count: towers, chunks, pieces, steps)."""
    return int_at_least(name, value, 1)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an ``int >= 0`` (an index, a seed, a length)."""
    return int_at_least(name, value, 0)


def positive_float(name: str, value: Any) -> float:
    """``value`` as a ``float > 0`` (seconds, a learning rate); ints are welcome."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def non_negative_float(name: str, value: Any) -> float:
    """``value`` as a finite ``float >= 0`` (a cost coefficient, a byte count)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or float(value) < 0):  # fmt: skip
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """``value`` when it is True or False (else a ``TypeError``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` when it is one of the names in ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def optional(check: Callable[[str, Any], T], name: str, value: Any) -> T | None:
    """``None``, or ``check(name, value)`` whose message says ``None`` was welcome too."""
    if value is None:
        return None
    try:
        return check(name, value)
    except ValueError as err:
        said = str(err)
        prefix = f"{name} must be "
        if said.startswith(prefix):
            said = f"{prefix}None or {said[len(prefix):]}"
        raise ValueError(said) from None


def naming(name: str, check: Callable[[], T]) -> T:
    """Run ``check``; a plain ``TypeError``/``ValueError`` whose message does not mention
    ``name`` (one from TensorFlow, say) is prefixed ``"<name>: "``."""
    try:
        return check()
    except (TypeError, ValueError) as err:
        if type(err) not in (TypeError, ValueError) or re.search(rf"\b{name}\b", str(err)):
            raise
        raise type(err)(f"{name}: {err}") from err
