"""What ``towers study`` compares: reducer specs as typed, turned into fresh reducers.

A spec is parsed by :func:`towers.allreduce.machinery.resolve.parse` (the one grammar:
``ring``, ``fp16``, ``topk(0.1)``, ``powersgd(4)@tree``, ``my_codecs:sign@tree``,
``my_algos:star``); :func:`build` makes its reducer. Codecs run with
``decode="everywhere"``: every tower decodes its own payload, so the bytes on the wire
are the codec's own (``decode="once"`` adds ``(n-1)·S`` dense bytes from tower 0
whatever the codec). Every :func:`build` makes a fresh reducer, so a codec's state
(error feedback, PowerSGD's ``Q``) never leaks from one run into another, and wraps the
dense all-reduce in a :class:`Counted` so the study knows the payload of every
all-reduce call (the cost model prices those; see :mod:`towers.study.cost`).

Example:
    >>> reducer, counted = build(parse("powersgd(4)"), devices)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.compressed import compressed
from towers.allreduce.machinery.primitives import Transfer, record
from towers.allreduce.machinery.resolve import Spec, get, is_reducer

__all__ = ["Counted", "build"]


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


def build(spec: Spec, devices: Sequence[str] = ()) -> tuple[Any, Counted | None]:
    """A fresh reducer for ``TowerTrainer(all_reduce=...)`` and its counted all-reduce
    (None when the reducer is a user's ``GradientReducer``, which the study cannot see into)."""
    fn = get(spec.algorithm, argument="reducer", devices=devices or None)
    if is_reducer(fn):
        return fn, None
    counted = Counted(fn)
    if spec.codec is None:
        return counted, counted
    return compressed(counted, spec.codec, decode="everywhere"), counted
