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

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from towers.allreduce.machinery.base import GradientReducer
from towers.allreduce.machinery.recording import record
from towers.allreduce.machinery.registry import ALGORITHMS, Configured, algorithm_name
from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.specs import import_spec
from towers.devices import local_devices, simulate_devices

__all__ = ["is_reducer", "load_algorithm", "start_devices"]


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


def is_reducer(obj: Any) -> bool:
    """A :class:`~towers.allreduce.machinery.base.GradientReducer` (all gradients at once)?"""
    return not isinstance(obj, type) and isinstance(obj, GradientReducer)


def _binds(sig: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _is_algorithm(obj: Any, devices: Sequence[str]) -> bool:
    """Does ``obj`` follow the contract ``obj(values, *, op)`` (else it is a factory)?

    Decided from the signature when it can only be one; otherwise by trying it on
    two small tensors (the sends of the probe are not recorded anywhere that lasts).
    """
    try:
        sig = inspect.signature(obj)
        as_algorithm, as_factory = _binds(sig, [], op="sum"), _binds(sig)
        if as_algorithm != as_factory:
            return as_algorithm
    except (TypeError, ValueError):
        pass
    import tensorflow as tf


    values = []
    for i, device in enumerate(devices[:2]):
        with tf.device(device):
            values.append(tf.fill([4], float(i + 1)))
    try:
        with record():
            out = obj(values, op="sum")
    except TypeError:
        return False
    return isinstance(out, (list, tuple)) and len(out) == len(values)


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
    name = spec if isinstance(spec, str) else algorithm_name(spec)
    if isinstance(spec, str) and spec.rsplit(":", 1)[0].endswith(".py"):
        name = Path(spec).name  # my_algos.py:star, not the whole path
    obj = _import(*spec.rsplit(":", 1)) if isinstance(spec, str) else spec
    if is_reducer(obj) or _is_algorithm(obj, devices):
        return name, _registered(obj)
    made = obj()
    if not callable(made) and not is_reducer(made):
        raise TypeError(f"{name} is neither an all-reduce nor a factory of one: gave {made!r}")
    return name, _registered(made)


def _registered(fn: Any) -> Any:
    """``fn`` as its registry record builds it, when a record in ``ALGORITHMS`` builds
    exactly ``fn`` (``register(Algorithm("star", lambda: star, ...))`` beside ``star``), so
    the tools find its formulas; else ``fn`` itself."""
    if isinstance(fn, Configured):
        return fn
    module, fn_name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    for entry in ALGORITHMS.values():
        if entry.name != fn_name and getattr(entry.factory, "__module__", None) != module:
            continue
        try:
            built = entry()
        except Exception:  # a factory that needs arguments cannot be this one
            continue
        if isinstance(built, Configured) and built.run is fn:
            return built
    return fn
