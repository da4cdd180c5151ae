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

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from towers.allreduce.machinery.base import GradientReducer
from towers.allreduce.machinery.recording import record
from towers.allreduce.machinery.registry import algorithm_name
from towers.allreduce.machinery.resolve import get
from towers.devices import local_devices, simulate_devices

__all__ = ["import_object", "is_reducer", "load_algorithm", "start_devices"]


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


def import_object(module: str, attr: str) -> Any:
    """``module.attr`` (``module`` may be a ``.py`` file; the current directory is searched).

    Raises:
        ValueError: the module does not import, or has no ``attr`` (its callables listed).
    """
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # `my_module:fn` from the current directory, last
    try:
        if module.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module).stem, module)
            if spec is None or spec.loader is None or not Path(module).is_file():
                raise ImportError(f"no such file: {module}")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = loaded  # as an import would (dataclasses look it up)
            spec.loader.exec_module(loaded)
        else:
            loaded = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"cannot import {module!r} for algorithm {module}:{attr} ({err})") from err
    obj: Any = loaded
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(loaded).items() if callable(v) and k[0] != "_")
            raise ValueError(
                f"module {module!r} has no {attr!r}; its callables: {', '.join(found) or 'none'}"
            )
        obj = getattr(obj, part)
    return obj


def _import(module: str, attr: str) -> Any:
    obj = import_object(module, attr)
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
        return name, obj
    made = obj()
    if not callable(made) and not is_reducer(made):
        raise TypeError(f"{name} is neither an all-reduce nor a factory of one: gave {made!r}")
    return name, made
