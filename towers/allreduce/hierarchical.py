"""Hierarchical all-reduce: reduce inside groups, all-reduce among group leaders, copy back.

Towers are cut into consecutive groups of ``group_size`` (k); the first tower of
each group is its leader. n = 4, k = 2::

    phase:     1 inner (per group)         2 outer (leaders only)      3 group broadcast
    ticks:     0 … a−1                     a … a+b−1                   a+b
    tower 0 *  inner(x0, x1)[0] = s01      outer(s01, s23)[0] = s      s ──▶ tower 1
    tower 1    (inner's copy unused)                                   ◀── s
    tower 2 *  inner(x2, x3)[0] = s23      outer(s01, s23)[1] = s      s ──▶ tower 3
    tower 3    (inner's copy unused)                                   ◀── s

Ticks run on from phase to phase: the groups' inner all-reduces run side by side
in ticks 0 … a−1 (a: the inner part's ticks), the outer one is shifted by
:func:`~towers.allreduce.primitives.tick_offset` to a … a+b−1, and the leaders'
copies to their members go at tick a+b. Only the recorded labels move.

Index formula: tower i is in group g = i // k, whose leader is g·k and whose
members are g·k … g·k + k − 1; leader g is tower g of the outer all-reduce.

How the parts are used: ``inner`` is a whole all-reduce run on each group's
values; only the leader's output (index 0) is kept. An all-reduce also delivers
the group sum to the other members; those copies are discarded (they are
recorded by :func:`~towers.allreduce.primitives.record`, and counted in
:func:`bytes_sent`; inside a ``tf.function`` TensorFlow prunes them as unused).
``outer`` all-reduces the leaders' group results. Both run with ``op="sum"``
when ``op="mean"``; each leader then divides its (bitwise identical) total by
n once, and copies it to its members with ``send``. Division is correctly
rounded, so equal totals give equal means on every leader.

Cost: inner(k, S) + outer(n/k, S) + (k − 1)·(α + Sβ) for the leader's copies;
with a fast inner link (NVLink) and a slow outer one (network) only the outer
phase crosses the slow link, on n/k towers instead of n.

References:
    Horovod hierarchical all-reduce (Sergeev & Del Balso, "Horovod", 2018);
    TensorFlow ``all_reduce.py`` two-level builders (``build_nccl_then_ring``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import tensorflow as tf

from towers.allreduce.base import AllReduce, check_values, finish
from towers.allreduce.primitives import Recorder, record, send, tick_offset

__all__ = ["bytes_sent", "hierarchical", "summation_depth"]

Part: TypeAlias = "str | AllReduce"


def _resolve(algorithm: Part) -> AllReduce:
    from towers.allreduce import get  # lazy: the registry imports this module

    return get(algorithm)


def _rooted_bytes(n: int, nbytes: int, itemsize: int) -> list[int]:
    return [(n - 1) * nbytes] + [nbytes] * (n - 1)


def _rooted_depth(n: int) -> int:
    return n - 1


def _baseline(fn: AllReduce, formula: str) -> Callable[..., Any] | None:
    """naive and parameter_device (on tower 0): everyone sends to tower 0, which sends back."""
    from towers.allreduce.naive import naive

    module = getattr(fn, "__module__", "")
    rooted = fn is naive or (
        module == "towers.allreduce.parameter_device" and getattr(fn, "device", None) is None
    )
    if not rooted:
        return None
    return _rooted_bytes if formula == "bytes_sent" else _rooted_depth


def _formula(algorithm: Part, formula: str) -> Callable[..., Any]:
    """A part's ``bytes_sent`` or ``summation_depth``: attribute, baseline, or module function."""
    fn = _resolve(algorithm)
    found = getattr(fn, formula, None) or _baseline(fn, formula)
    if found is None and isinstance(algorithm, str):  # a registry default: module defaults fit
        found = getattr(sys.modules.get(getattr(fn, "__module__", "")), formula, None)
    if found is None:
        raise ValueError(f"{algorithm!r} exposes no {formula}(): cannot compute hierarchical's")
    return found


def _check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    return group_size


def _groups(n: int, group_size: int) -> int:
    if n % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the tower count {n}: "
            "every group must have the same number of towers"
        )
    return n // group_size


def _after(seen: Recorder, start: int, shift: int) -> int:
    """The tick after a phase that began at ``start`` (``start`` if it gave no ticks).

    ``seen`` holds the phase's sends, recorded under ``tick_offset(start)``; ``shift``
    is the total offset that was in effect, enclosing ones (a hierarchical inside
    another) included, which are taken off again.
    """
    ticks = [t.tick for t in seen.transfers if t.tick is not None]
    return max(start, max(ticks) - shift + start + 1) if ticks else start


def _all_reduce(
    values: Sequence[tf.Tensor], op: str, inner: Part, outer: Part, group_size: int
) -> list[tf.Tensor]:
    devices = check_values(values, op)
    n, k = len(values), group_size
    groups = _groups(n, k)
    inner_fn, outer_fn = _resolve(inner), _resolve(outer)
    part_op = "sum" if op == "mean" else op
    # Each part numbers its ticks from 0: shift the outer phase after the inner one, and the
    # group broadcast after both, so the recorded schedule reads as three phases in a row.
    with record() as seen, tick_offset(0) as shift:
        leaders = [inner_fn(list(values[g * k : (g + 1) * k]), op=part_op)[0]
                   for g in range(groups)]
    start = _after(seen, 0, shift)
    with record() as seen, tick_offset(start) as shift:
        totals = outer_fn(leaders, op=part_op)
    start = _after(seen, start, shift)
    outputs: list[tf.Tensor] = []
    for g, total in enumerate(totals):
        with tf.device(devices[g * k]):
            total = finish(total, op, n)
        for member in range(g * k, (g + 1) * k):
            outputs.append(
                send(total, devices[member], tick=start, chunk=g, note="group-broadcast")
            )
    return outputs


def hierarchical(inner: Part = "naive", outer: Part = "ring", group_size: int = 2) -> AllReduce:
    """Build a two-level all-reduce: ``inner`` within groups, ``outer`` among group leaders.

    Args:
        inner: all-reduce run inside each group of ``group_size`` consecutive towers
            (a registry name, resolved when called, or a callable).
        outer: all-reduce run among the group leaders (name or callable).
        group_size: towers per group; it must divide the tower count.

    Returns:
        An all-reduce callable with ``bytes_sent`` and ``summation_depth`` attributes.

    Raises:
        TypeError: ``group_size`` not an int, or a part neither a name nor a callable.
        ValueError: ``group_size`` < 1; when called, ``group_size`` not dividing the
            tower count, an unknown part name, or bad values.

    Example:
        >>> algo = hierarchical("naive", halving_doubling(), group_size=4)  # doctest: +SKIP
        >>> outs = algo(values, op="mean")                                  # doctest: +SKIP
    """
    _check_group_size(group_size)
    for name, part in (("inner", inner), ("outer", outer)):
        if not isinstance(part, str) and not callable(part):
            raise TypeError(f"{name} must be a registry name or an all-reduce callable: {part!r}")

    def hierarchical_all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return _all_reduce(values, op, inner, outer, group_size)

    fn: Any = hierarchical_all_reduce
    fn.bytes_sent = functools.partial(bytes_sent, inner=inner, outer=outer, group_size=group_size)
    fn.summation_depth = functools.partial(
        summation_depth, inner=inner, outer=outer, group_size=group_size
    )
    return hierarchical_all_reduce


def bytes_sent(
    n: int, nbytes: int, itemsize: int, *, inner: Part = "naive", outer: Part = "ring",
    group_size: int = 2,
) -> list[int]:
    """Exact bytes each tower sends for one all-reduce of ``nbytes`` per tower.

    Member r of group g sends ``inner(k)[r]``; a leader adds ``outer(n/k)[g]`` and
    (k − 1)·nbytes of group broadcast. The parts' own ``bytes_sent`` give their shares.

    Example:
        >>> bytes_sent(4, 8, 4, inner="naive", outer="naive", group_size=2)
        [24, 8, 24, 8]
    """
    k = _check_group_size(group_size)
    groups = _groups(n, k)
    inner_b = _formula(inner, "bytes_sent")(k, nbytes, itemsize)
    outer_b = _formula(outer, "bytes_sent")(groups, nbytes, itemsize)
    out = []
    for i in range(n):
        g, r = divmod(i, k)
        extra = outer_b[g] + (k - 1) * nbytes if r == 0 else 0
        out.append(inner_b[r] + extra)
    return out


def summation_depth(
    n: int, *, inner: Part = "naive", outer: Part = "ring", group_size: int = 2
) -> int:
    """Most additions on any element: inner's depth on k towers plus outer's on n/k.

    Example:
        >>> summation_depth(8, inner="naive", outer="naive", group_size=4)
        4
    """
    k = _check_group_size(group_size)
    groups = _groups(n, k)
    inner_d = _formula(inner, "summation_depth")(k)
    outer_d = _formula(outer, "summation_depth")(groups)
    return int(inner_d) + int(outer_d)
