"""Every name a user types for an all-reduce or a codec, turned into the object: one grammar
for the library (trainers, ``towers.all_reduce``, the wrappers), the CLI, trace and study::

    ring                   a registered all-reduce (ALGORITHMS), or noop
    fp16, topk(0.1)        a registered codec (codecs.CODECS), its arguments Python literals
    mod:NAME, file.py:NAME a user's all-reduce, GradientReducer or codec, or a factory of
                           one (called with no arguments); NAME may be dotted
    CODEC@ALGO             a reducer spec (:func:`parse`): CODEC over ALGO (default ring)

A name nothing holds is a ``ValueError`` naming the argument, the registered names and
the closest ("did you mean 'ring'?").
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tensorflow as tf

from towers.allreduce.codecs import CODECS, Codec
from towers.allreduce.machinery.base import AllReduce, GradientReducer
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.primitives import record
from towers.allreduce.machinery.registry import ALGORITHMS, Configured, Record, algorithm_name
from towers.allreduce.naive import noop
from towers.allreduce.parameter_device import parameter_device as _on_device

__all__ = ["Spec", "check", "get", "get_codec", "imported", "is_reducer", "label", "parse"]


def _unknown(argument: str, value: str, names: Iterable[str]) -> ValueError:
    """The one message for a name no registry holds: the registered names, and the closest."""
    names = sorted(names)
    close = ([n for n in names if n.lower() == value.lower()]
             or difflib.get_close_matches(value, names, n=3))
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return ValueError(f"unknown {argument} {value!r}{hint}; registered: {', '.join(names)} "
                      "(or name your own as module:NAME)")


def imported(spec: str, argument: str = "all_reduce") -> Any:
    """The object ``module:NAME`` (or ``file.py:NAME``; the cwd searched last) names, unchecked."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{argument} {spec!r}: expected module:NAME or file.py:NAME")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        loaded = _load_module(module)
    except Exception as err:  # ImportError, and whatever the module raises (SyntaxError, ...)
        raise ValueError(f"cannot import {module!r} for {argument} {spec} "
                         f"({type(err).__name__}: {err})") from err
    obj: Any = loaded
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(loaded).items() if callable(v) and k[0] != "_")
            raise ValueError(f"module {module!r} has no {attr!r}; its callables: "
                             f"{', '.join(found) or 'none'} (for {argument} {spec})")
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


def is_reducer(obj: Any) -> bool:
    """A :class:`~towers.allreduce.machinery.base.GradientReducer` instance?"""
    return not isinstance(obj, type) and isinstance(obj, GradientReducer)


def check(text: str, argument: str = "all_reduce") -> Any:
    """What ``text`` names as an all-reduce, checked but not built (before TensorFlow starts):
    a registered name as it is, else what ``module:NAME`` imports."""
    if ":" in text:
        obj = imported(text, argument)
        if not callable(obj) and not is_reducer(obj):
            raise ValueError(f"{argument} {text} is a {type(obj).__name__}, not an all-reduce, "
                             "a GradientReducer or a factory of either")
        return obj
    if text != "noop" and text not in ALGORITHMS:
        raise _unknown(argument, text, [*ALGORITHMS, "noop"])
    return text


def get(algorithm: str | AllReduce | GradientReducer, *, argument: str = "all_reduce",
        devices: Sequence[str] | None = None, parameter_device: str | None = None) -> Any:
    """The all-reduce (or ``GradientReducer``) ``algorithm`` names; a callable passes through.

    ``module:NAME`` may name a factory of either (when the signature cannot tell, one call
    on two small tensors on ``devices`` decides); it comes back as its registry record
    builds it, if one does. ``parameter_device``: the device ``"parameter_device"`` means.
    """
    if not isinstance(algorithm, str):
        if callable(algorithm) or is_reducer(algorithm):
            return algorithm
        raise TypeError(f"{argument} must be a registered name or a callable, got {algorithm!r}")
    found = check(algorithm, argument)
    if isinstance(found, str):
        if found == "noop":
            return noop
        if found == "parameter_device" and parameter_device is not None:
            return _on_device(parameter_device)
        return ALGORITHMS[found]()
    if not is_reducer(found) and not _is_algorithm(found, devices):
        try:
            found = found()
        except TypeError as err:
            raise ValueError(f"{argument} {algorithm}: neither an all-reduce (values, *, op) "
                             f"nor a factory taking no arguments ({err})") from err
        if not callable(found) and not is_reducer(found):
            raise ValueError(f"{argument} {algorithm}: {algorithm}() made a "
                             f"{type(found).__name__}: not an all-reduce or a GradientReducer")
    return _registered(found)


def label(algorithm: Any) -> str:
    """What tools call ``algorithm``: the name as typed (``file.py:NAME`` without its folder)."""
    if not isinstance(algorithm, str):
        return algorithm_name(algorithm)
    module, _, attr = algorithm.rpartition(":")
    return f"{Path(module).name}:{attr}" if module.endswith(".py") else algorithm


def _binds(sig: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _is_algorithm(obj: Any, devices: Sequence[str] | None) -> bool:
    """Does ``obj`` take ``(values, *, op)`` (else it is a factory)? By its signature, or a try."""
    try:
        sig = inspect.signature(obj)
        as_algorithm, as_factory = _binds(sig, [], op="sum"), _binds(sig)
        if as_algorithm != as_factory:
            return as_algorithm
    except (TypeError, ValueError):
        pass
    if not devices:  # probe on the first two devices TensorFlow has
        devices = [d.name for d in tf.config.list_logical_devices()][:2]
    values = per_tower(devices[:2], lambda i: tf.fill([4], float(i + 1)))
    try:
        with record():
            out = obj(values, op="sum")
    except TypeError:
        return False
    return isinstance(out, (list, tuple)) and len(out) == len(values)


def _registered(fn: Any) -> Any:
    """``fn`` as the record in ``ALGORITHMS`` that builds exactly ``fn`` builds it, else ``fn``."""
    if isinstance(fn, Configured):
        return fn
    module, fn_name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    for entry in ALGORITHMS.values():
        if entry.name == fn_name or getattr(entry.factory, "__module__", None) == module:
            try:
                built = entry()
            except Exception:  # a factory that needs arguments cannot be this one
                continue
            if isinstance(built, Configured) and built.run is fn:
                return built
    return fn


def _call(text: str, argument: str) -> tuple[str, tuple[Any, ...]]:
    """``name(args)`` -> ``(name, args)`` with literal arguments; ``name`` -> ``(name, ())``."""
    if "(" not in text:
        return text, ()
    name, _, rest = text.partition("(")
    if not rest.endswith(")"):
        raise ValueError(f"{argument} {text!r}: expected name(arguments)")
    try:
        args = ast.literal_eval(f"({rest[:-1]},)") if rest[:-1].strip() else ()
    except (ValueError, SyntaxError) as err:
        raise ValueError(f"{argument} {text!r}: arguments must be Python literals "
                         f"({err})") from None
    return name.strip(), tuple(args)


def get_codec(codec: str | Codec | Record, *, argument: str = "codec") -> Codec:
    """A fresh codec from a name in :data:`CODECS` (``name(args)`` passes arguments), a
    record, a codec, a codec class or factory, or ``module:NAME`` of any of these."""
    if not isinstance(codec, str):
        return _as_codec(repr(codec), codec, argument)
    if ":" in codec:
        return _as_codec(codec, imported(codec, argument), argument)
    name, args = _call(codec, argument)
    if name not in CODECS:
        raise _unknown(argument, name, CODECS)
    try:
        made = CODECS[name](*args)
    except TypeError as err:
        raise ValueError(f"{argument} {codec}: {err}") from None
    return _as_codec(codec, made, argument)


def _as_codec(name: str, obj: Any, argument: str) -> Codec:
    if isinstance(obj, Record) and obj.kind != "codec":
        raise ValueError(f"{argument}: {name} is a record of kind {obj.kind!r}, not a codec")
    if (isinstance(obj, type) or not isinstance(obj, Codec)) and callable(obj):
        try:
            obj = obj()  # a class, a record or a factory: its defaults
        except TypeError as err:
            raise ValueError(f"{argument}: {name} must be a codec (with init() and reduce()) or "
                             f"a factory of one taking no arguments; calling it: {err}") from err
    if isinstance(obj, type) or not isinstance(obj, Codec):
        raise ValueError(f"{argument}: {name} must be a codec (with init() and reduce()) or a "
                         f"factory of one, got {obj!r}")
    return obj


class Spec(NamedTuple):
    """A reducer spec, parsed: ``codec`` (None: uncompressed) over ``algorithm``."""

    text: str
    algorithm: str
    codec: str | None = None


def parse(spec: str, argument: str = "reducer") -> Spec:
    """Check a reducer spec (the module docstring's grammar; the codec is built once)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{argument} must be a non-empty string, got {spec!r}")
    text = spec.strip()
    head, _, after = text.rpartition("@") if "@" in text else (text, "", "")
    if after:
        check(after, "all_reduce")
    if _is_codec(head, argument):
        get_codec(head, argument=argument)
        return Spec(text, after or "ring", head)
    if after:
        raise ValueError(f"{argument} {text!r}: {head} is an all-reduce; @ALGO follows a codec")
    if "(" in head:
        raise ValueError(f"{argument} {text!r}: an all-reduce takes no arguments here; name a "
                         "configured one as module:NAME")
    return Spec(text, head)


def _is_codec(head: str, argument: str) -> bool:
    """Does ``head`` name a codec (else an all-reduce or a GradientReducer)?"""
    if ":" not in head:
        name = _call(head, argument)[0]
        if name in CODECS:
            return True
        if name == "noop" or name in ALGORITHMS:
            return False
        raise _unknown(argument, name, [*CODECS, *ALGORITHMS, "noop"])
    obj = imported(head, argument)
    if isinstance(obj, (Record, Codec)):  # a record, a codec or a codec's class
        return not isinstance(obj, Record) or obj.kind == "codec"
    check(head, argument)  # else a callable or a GradientReducer
    try:
        if is_reducer(obj) or _binds(inspect.signature(obj), [], op="sum"):
            return False  # a GradientReducer, or it takes (values, *, op)
        made = obj()
    except (TypeError, ValueError):
        return False
    if isinstance(made, Codec) and not callable(made):
        return True
    if not callable(made) and not is_reducer(made):
        raise ValueError(f"{argument} {head}: {head}() made a {type(made).__name__}: not an "
                         "all-reduce, a GradientReducer or a codec")
    return False
