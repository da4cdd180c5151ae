"""What ``towers study`` compares: reducer specs as typed, turned into fresh reducers.

One spec names one way to reduce a step's gradients::

    ring                 a registered all-reduce (towers.ALGORITHMS), uncompressed
    fp16, bf16           a registered codec (towers.allreduce.CODECS) over ring
    topk(0.1)            a codec with its arguments (Python literals)
    powersgd(4)@tree     a codec over another all-reduce
    my_codecs:sign       a user's codec (an object with init and reduce, or a factory
                         of one), over ring unless @ALGO follows
    my_algos:star        a user's all-reduce or GradientReducer (or a factory of one)

Codecs run with ``decode="everywhere"``: every tower decodes its own payload, so the
bytes on the wire are the codec's own (``decode="once"`` adds ``(n-1)·S`` dense bytes
from tower 0 whatever the codec). Every :meth:`Entry.build` makes a fresh reducer,
so a codec's state (error feedback, PowerSGD's ``Q``) never leaks from one run into
another, and wraps the dense all-reduce in a :class:`Counted` so the study knows the
payload of every all-reduce call (the cost model prices those; see
:mod:`towers.study.cost`).

Example:
    >>> entry = parse_spec("powersgd(4)")                  # doctest: +SKIP
    >>> reducer, counted = entry.build()                     # doctest: +SKIP
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.codecs import Codec
from towers.allreduce.compressed import CODECS, compressed
from towers.allreduce.machinery.recording import Transfer, record
from towers.allreduce.machinery.registry import ALGORITHMS
from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.specs import import_spec
from towers.trace.loading import is_reducer, load_algorithm

__all__ = ["Counted", "Entry", "parse_spec"]


class Counted:
    """An all-reduce that notes, per call, the payload each tower gives it and what it sent.

    ``calls`` is filled when a step is traced: per call, the payload in bytes per
    tower and the transfers the call made (the very objects the step's recorder
    holds, so a study keeps the calls of the trace it reads).
    """

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm
        self.calls: list[tuple[int, tuple[Transfer, ...]]] = []

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        with record() as inner:
            out = list(self.algorithm(values, op=op))
        first = values[0]
        payload = int(first.shape.num_elements() or 0) * first.dtype.size
        self.calls.append((payload, tuple(inner.transfers)))
        return out


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parsed spec: ``label`` as typed, the dense ``algorithm``'s name (None: a user's
    whole reducer) and the codec's spec (None: uncompressed)."""

    label: str
    algorithm: str | None
    codec: str | None = None
    user: str | None = None  # module:NAME of a user's all-reduce or reducer

    def build(self, devices: Sequence[str] = ()) -> tuple[Any, Counted | None]:
        """A fresh reducer for ``TowerTrainer(all_reduce=...)`` and its counted all-reduce
        (None when the reducer is a user's ``GradientReducer``, which the study cannot see into)."""
        if self.user is not None:
            _, fn = load_algorithm(self.user, devices)
            if is_reducer(fn):
                return fn, None
            counted = Counted(fn)
            return counted, counted
        counted = Counted(get(self.algorithm or "ring"))
        if self.codec is None:
            return counted, counted
        return compressed(counted, _codec(self.codec), decode="everywhere"), counted


def _call(text: str) -> tuple[str, tuple[Any, ...]]:
    """``name(args)`` -> ``(name, args)`` with literal arguments; ``name`` -> ``(name, ())``."""
    if "(" not in text:
        return text, ()
    name, _, rest = text.partition("(")
    if not rest.endswith(")"):
        raise ValueError(f"{text!r}: expected name(arguments)")
    try:
        args = ast.literal_eval(f"({rest[:-1]},)") if rest[:-1].strip() else ()
    except (ValueError, SyntaxError) as err:
        raise ValueError(f"{text!r}: arguments must be Python literals ({err})") from None
    return name.strip(), tuple(args)


def _codec(spec: str) -> Codec:
    """A fresh codec from ``name(args)`` or ``module:NAME`` (an instance or a factory)."""
    if ":" in spec:
        obj = import_spec(spec, "codec")
        if isinstance(obj, type) or (not isinstance(obj, Codec) and callable(obj)):
            obj = obj()  # a codec class or a factory of codecs
        if not isinstance(obj, Codec):
            raise ValueError(f"{spec}: not a codec (no init and reduce): {obj!r}")
        return obj
    name, args = _call(spec)
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    try:
        made: Codec = CODECS[name](*args)
    except TypeError as err:
        raise ValueError(f"{spec}: {err}") from None
    return made


def _user_kind(spec: str) -> str:
    """``"codec"`` when ``module:NAME`` holds a codec, its class or a factory of one, else
    ``"algorithm"`` (an all-reduce, a ``GradientReducer`` or a factory of either)."""
    obj = import_spec(spec)
    if isinstance(obj, Codec):  # an instance, or a class with init and reduce
        return "codec"
    if is_reducer(obj):
        return "algorithm"
    if not callable(obj):  # refused now, not after the specs before it have trained
        raise ValueError(f"{spec} is a {type(obj).__name__}: not an all-reduce, a "
                         "GradientReducer, a codec or a factory of one")
    try:
        inspect.signature(obj).bind([], op="sum")
        return "algorithm"  # it takes (values, *, op)
    except (TypeError, ValueError):
        pass
    try:
        made = obj()
    except TypeError:
        return "algorithm"
    if isinstance(made, Codec) and not callable(made):
        return "codec"
    if not callable(made) and not is_reducer(made):
        raise ValueError(f"{spec}() made a {type(made).__name__}: not an all-reduce, a "
                         "GradientReducer or a codec")
    return "algorithm"


def parse_spec(spec: str) -> Entry:
    """Check one spec (see the module docstring) without building anything.

    Raises:
        ValueError: an empty spec, an unknown algorithm or codec, bad arguments, a
            module that does not import (each naming the spec).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a reducer spec must be a non-empty string, got {spec!r}")
    text = spec.strip()
    head, _, algorithm = text.rpartition("@") if "@" in text else (text, "", "")
    if algorithm and algorithm not in ALGORITHMS:
        raise ValueError(f"{spec}: unknown all-reduce {algorithm!r} after @; known: "
                         f"{', '.join(sorted(ALGORITHMS))}")
    if ":" in head and _user_kind(head) == "algorithm":
        if algorithm:
            raise ValueError(f"{spec}: @{algorithm} follows a codec, not an all-reduce")
        return Entry(text, None, user=head)
    if ":" not in head and _call(head)[0] in ALGORITHMS:
        if _call(head)[1]:
            raise ValueError(f"{spec}: an all-reduce takes no arguments here; name a "
                             "configured one as module:NAME")
        if algorithm:
            raise ValueError(f"{spec}: {head} is an all-reduce; @ALGO follows a codec")
        return Entry(text, head)
    _codec(head)  # the name and its arguments are checked now, before any training
    return Entry(text, algorithm or "ring", codec=head)
