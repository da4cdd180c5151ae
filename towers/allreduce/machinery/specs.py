"""What a user types for their own algorithm or codec, ``module:NAME``, turned into the object.

The one place for every tool and every registry kind: ``towers trace|check|bench
--algorithm mymod:star`` (through :func:`towers.trace.loading.load_algorithm`) and
``compressed("ring", "mymod:my_codec")`` (through
:func:`towers.allreduce.compressed.get_codec`) both import with :func:`import_spec`.

Example:
    >>> star = import_spec("my_algos.py:star")         # doctest: +SKIP
    >>> codec = import_spec("mymod:my_codec", "codec")  # doctest: +SKIP
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

import tensorflow as tf

from towers.allreduce.machinery.base import GradientReducer
from towers.allreduce.machinery.recording import record
from towers.allreduce.machinery.registry import ALGORITHMS, Configured, algorithm_name

__all__ = ["import_spec", "is_reducer", "is_spec", "user_algorithm"]


def is_spec(text: str) -> bool:
    """Does ``text`` name a user's object (``module:NAME``) rather than a registry name?"""
    return ":" in text


def import_spec(spec: str, what: str = "algorithm") -> Any:
    """The object named by ``module:NAME`` (or ``file.py:NAME``; ``NAME`` may be dotted).

    The current directory is searched last, so ``my_module:fn`` finds ``./my_module.py``.

    Args:
        spec: ``module:NAME`` or ``path/to/file.py:NAME``.
        what: what the object is for, named in the errors (``"algorithm"``, ``"codec"``).

    Returns:
        The attribute, unchecked (a record, a factory, an instance).

    Raises:
        ValueError: no ``:``, a module that does not import (whatever it raised), or a
            missing attribute.
    """
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {spec!r}: expected module:NAME or file.py:NAME")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        loaded = _load_module(module)
    except Exception as err:  # ImportError, and whatever the module raises (SyntaxError, ...)
        raise ValueError(f"cannot import {module!r} for {what} {spec} "
                         f"({type(err).__name__}: {err})") from err
    obj: Any = loaded
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(loaded).items() if callable(v) and k[0] != "_")
            raise ValueError(f"module {module!r} has no {attr!r}; its callables: "
                             f"{', '.join(found) or 'none'} (for {what} {spec})")
        obj = getattr(obj, part)
    return obj


def _load_module(module: str) -> Any:
    if not module.endswith(".py"):
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location(Path(module).stem, module)
    if spec is None or spec.loader is None or not Path(module).is_file():
        raise ImportError(f"no such file: {module}")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # as an import would (dataclasses look it up)
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        sys.modules.pop(spec.name, None)  # as a failed import does: no half-made module left
        raise
    return loaded


def user_algorithm(spec: str | Callable[..., Any],
                   devices: Sequence[str] | None = None) -> tuple[str, Any]:  # fmt: skip
    """A user's all-reduce from ``module:NAME`` (or ``file.py:NAME``) or a callable.

    ``NAME`` may be an algorithm (``algorithm(values, *, op)``), a ``GradientReducer``, or
    a factory of either, called with no arguments (``my_module:make_star``). When the
    signature cannot tell an algorithm from a factory, one call on two small tensors on
    ``devices`` (the first two TensorFlow devices when None) does.

    Returns:
        ``(name, algorithm)``: its registry record's build when one builds exactly it.

    Raises:
        ValueError: a module that does not import, a missing attribute.
        TypeError: the attribute (or what its factory returns) is not callable.
    """
    name = spec if isinstance(spec, str) else algorithm_name(spec)
    if isinstance(spec, str) and spec.rsplit(":", 1)[0].endswith(".py"):
        name = Path(spec).name  # my_algos.py:star, not the whole path
    obj: Any = spec
    if isinstance(spec, str):
        obj = import_spec(spec)
        if not callable(obj) and not is_reducer(obj):
            raise TypeError(f"{spec} is a {type(obj).__name__}, not a callable (an "
                            "all-reduce, a factory of one or a GradientReducer)")  # fmt: skip
    if is_reducer(obj) or _is_algorithm(obj, devices):
        return name, _registered(obj)
    made = obj()
    if not callable(made) and not is_reducer(made):
        raise TypeError(f"{name} is neither an all-reduce nor a factory of one: gave {made!r}")
    return name, _registered(made)


def is_reducer(obj: Any) -> bool:
    """A :class:`~towers.allreduce.machinery.base.GradientReducer` (all gradients at once)?"""
    return not isinstance(obj, type) and isinstance(obj, GradientReducer)


def _binds(sig: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _is_algorithm(obj: Any, devices: Sequence[str] | None) -> bool:
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
    if not devices:  # probe on the first two devices TensorFlow has
        devices = [d.name for d in tf.config.list_logical_devices()][:2]
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
