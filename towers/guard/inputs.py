"""The trainer's arguments and a step's batch, checked before anything is traced.

Each check raises ``TypeError`` (the wrong kind of object) or ``ValueError`` (the right
kind, a wrong value) naming the argument and what was expected; docs/bad_inputs.md
lists every case the tests hold.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_choice"]


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices``.

    Raises:
        ValueError: it is not (the message lists the choices).
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value
