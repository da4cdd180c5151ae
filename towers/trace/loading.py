"""Load an all-reduce for the tools: a registry name, ``module:function``, ``file.py:function``.

This module owns turning what a user types (``towers trace``, ``towers check``,
``towers timeline``) into an algorithm, and starting the devices it runs on:
:func:`load_algorithm` resolves a registry name, imports ``module:function`` (or a
file's function) or passes a callable through, and calls a factory (anything that
does not follow the contract ``algorithm(values, *, op)``) with no arguments;
:func:`start_devices` gives the tools their devices whether or not TensorFlow has
started. It runs nothing of the algorithm beyond the probe that tells an algorithm
from a factory when the signature cannot.

Example:
    >>> devices = start_devices(4)                                # doctest: +SKIP
    >>> name, fn = load_algorithm("my_algos.py:star", devices)    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.specs import import_spec, is_reducer, user_algorithm
from towers.devices import local_devices, simulate_devices

__all__ = ["load_algorithm", "start_devices"]


def start_devices(n: int) -> list[str]:
    """``towers.simulate_devices(n)``, or the first ``n`` devices if TensorFlow already runs.

    Raises:
        RuntimeError: TensorFlow already started with fewer than ``n`` devices.
    """
    try:
        return simulate_devices(n)
    except RuntimeError:
        have = local_devices()
        if len(have) < n:
            raise
        return have[:n]


def _import(module: str, attr: str) -> Any:
    obj = import_spec(f"{module}:{attr}")
    if not callable(obj) and not is_reducer(obj):
        raise TypeError(f"{module}:{attr} is a {type(obj).__name__}, not a callable")
    return obj


def load_algorithm(spec: str | Callable[..., Any], devices: Sequence[str]) -> tuple[str, Any]:
    """Resolve a registry name, ``module:function`` (or ``file.py:function``) or a callable.

    A factory (anything that does not follow the algorithm contract) is called with
    no arguments, so ``my_module:make_star`` works as well as ``my_module:star``.
    A ``GradientReducer`` (or a factory of one) is returned as it is, for the trainer.

    Returns:
        ``(name, algorithm)``.

    Raises:
        ValueError: an unknown name, a module that does not import, a missing attribute.
        TypeError: the attribute (or what its factory returns) is not callable.
    """
    if isinstance(spec, str) and ":" not in spec:
        try:
            return spec, get(spec)
        except ValueError as err:
            raise ValueError(f"{err}; or name your own as module:function") from None
    return user_algorithm(spec, devices)
