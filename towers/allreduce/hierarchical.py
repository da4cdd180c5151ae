"""Hierarchical all-reduce: reduce inside groups, all-reduce among group leaders, copy back.

Towers are cut into consecutive groups of ``group_size`` (k), the last holding the
remainder; each group's first tower is its leader. n = 4, k = 2::

    phase:     1 inner (per group)         2 outer (leaders only)      3 group broadcast
    ticks:     0 … a−1                     a … a+b−1                   a+b
    tower 0 *  inner(x0, x1)[0] = s01      outer(s01, s23)[0] = s      s ──▶ tower 1
    tower 1    (inner's copy unused)                                   ◀── s
    tower 2 *  inner(x2, x3)[0] = s23      outer(s01, s23)[1] = s      s ──▶ tower 3
    tower 3    (inner's copy unused)                                   ◀── s

Index formula: tower i is in group g = i // k, whose leader g·k is tower g of the outer
all-reduce on ⌈n/k⌉ leaders.

Only the leader's output of ``inner`` is kept; for ``op="mean"`` both parts sum and
each leader divides by n once. Cost: max over groups of inner(k_g, S) (coefficient-wise:
an upper bound) + outer(⌈n/k⌉, S) + (k_max − 1)·(α + Sβ) for the leader's copies.

References:
    Horovod hierarchical all-reduce (Sergeev & Del Balso, "Horovod", 2018);
    TensorFlow ``all_reduce.py`` two-level builders (``build_nccl_then_ring``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values, finish
from towers.allreduce.machinery.primitives import Recorder, record, send, tick_offset
from towers.allreduce.machinery.registry import (
    ALGORITHMS,
    Algorithm,
    Coefficients,
    Configured,
    register,
    schedule_of,
)
from towers.allreduce.machinery.resolve import get
from towers.guard.arguments import positive_int

__all__ = ["bytes_sent", "cost", "cost_levels", "group_sizes", "hierarchical", "summation_depth"]

Part: TypeAlias = "str | AllReduce"


def _formula(part: Part, what: str, *args: Any) -> Any:
    """``part``'s ``what`` formula (``bytes_sent``, ``summation_depth``) at ``args``."""
    fn = get(part)
    if not isinstance(fn, Configured):
        raise ValueError(f"{part!r} has no registry record: cannot compute hierarchical's "
                         f"{what}(); register(Algorithm(...)) it or pass a registered one")
    value = getattr(fn, what)(*args)
    if value is None:
        raise ValueError(f"{part!r} has no {what} formula: cannot compute hierarchical's")
    return value


def group_sizes(n: int, group_size: int) -> list[int]:
    """Consecutive groups of ``group_size``; the last holds the remainder (7, 2: 2, 2, 2, 1)."""
    k = positive_int("group_size", group_size)
    return [min(k, n - start) for start in range(0, n, k)]


def _after(seen: Recorder, start: int, shift: int) -> int:
    """The tick after a phase that began at ``start`` (``shift``: the offset in effect)."""
    ticks = [t.tick for t in seen.transfers if t.tick is not None]
    return max(start, max(ticks) - shift + start + 1) if ticks else start


def _all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum", inner: Part, outer: Part,
                group_size: int) -> list[tf.Tensor]:
    devices = check_values(values, op)
    n, k = len(values), group_size
    starts = range(0, n, k)
    inner_fn, outer_fn = get(inner), get(outer)
    part_op = "sum" if op == "mean" else op
    # Each part numbers its ticks from 0: shift the outer phase after the inner one, and the
    # group broadcast after both, so the recorded schedule reads as three phases in a row.
    with record() as seen, tick_offset(0) as shift:
        leaders = [inner_fn(list(values[s : s + k]), op=part_op)[0] for s in starts]
    start = _after(seen, 0, shift)
    with record() as seen, tick_offset(start) as shift:
        totals = outer_fn(leaders, op=part_op)
    start = _after(seen, start, shift)
    outputs: list[tf.Tensor] = []
    for g, (first, total) in enumerate(zip(starts, totals, strict=True)):
        with tf.device(devices[first]):
            total = finish(total, op, n)
        outputs += [send(total, devices[member], tick=start, chunk=g, note="group-broadcast")
                    for member in range(first, min(first + k, n))]
    return outputs


def _build(inner: Part = "naive", outer: Part = "ring", group_size: int = 2) -> AllReduce:
    """Build a two-level all-reduce: ``inner`` within groups, ``outer`` among group leaders
    (registry names, resolved when called, or callables).

    Raises:
        TypeError: a part neither a name nor a callable.
        ValueError: ``group_size`` not an int >= 1; when called, an unknown part or bad values.
    """
    positive_int("group_size", group_size)
    for name, part in (("inner", inner), ("outer", outer)):
        if not isinstance(part, str) and not callable(part):
            raise TypeError(f"{name} must be a registry name or an all-reduce callable: {part!r}")
    return functools.partial(_all_reduce, inner=inner, outer=outer, group_size=group_size)


def bytes_sent(
    n: int, nbytes: int, itemsize: int, *, inner: Part = "naive", outer: Part = "ring",
    group_size: int = 2,
) -> list[int]:
    """Bytes per tower: ``inner(k_g)[r]``, a leader adding ``outer(⌈n/k⌉)[g]`` and
    (k_g − 1)·nbytes of group broadcast."""
    sizes = group_sizes(n, group_size)
    outer_b = _formula(outer, "bytes_sent", len(sizes), nbytes, itemsize)
    out: list[int] = []
    for g, size in enumerate(sizes):
        inner_b = _formula(inner, "bytes_sent", size, nbytes, itemsize)
        out.append(int(inner_b[0] + outer_b[g] + (size - 1) * nbytes))
        out += [int(b) for b in inner_b[1:]]
    return out


def summation_depth(
    n: int, *, inner: Part = "naive", outer: Part = "ring", group_size: int = 2
) -> int:
    """Most additions on any element: inner's depth on the groups plus outer's on ⌈n/k⌉."""
    sizes = group_sizes(n, group_size)
    inner_d = max(_formula(inner, "summation_depth", k) for k in set(sizes)) if sizes else 0
    return int(inner_d) + int(_formula(outer, "summation_depth", len(sizes)))


def _flat_cost(name: Any, key: str) -> Callable[..., Coefficients]:
    record = ALGORITHMS.get(name) if isinstance(name, str) else None
    if record is None or record.cost is None or name == "hierarchical":
        raise ValueError(f"{key} must be a flat all-reduce name, got {name!r}")
    return record.cost


def cost_levels(
    n: int, nbytes: float, *, inner: str = "naive", outer: str = "ring", group_size: int = 2
) -> tuple[Coefficients, Coefficients]:
    """``(within groups, among leaders)``: the coefficients on the inner and outer links."""
    inner_cost, outer_cost = _flat_cost(inner, "inner"), _flat_cost(outer, "outer")
    sizes = group_sizes(n, group_size)
    parts = [inner_cost(size, nbytes) if size > 1 else (0, 0, 0) for size in sorted(set(sizes))]
    a, b, c = (max(col) for col in zip(*parts, strict=True))
    copies = max(sizes) - 1
    within = (a + copies, b + copies * nbytes, c)
    return within, outer_cost(len(sizes), nbytes) if len(sizes) > 1 else (0, 0, 0)


def cost(
    n: int, nbytes: float, *, inner: str = "naive", outer: str = "ring", group_size: int = 2
) -> Coefficients:
    """α-β-γ coefficients: the sum of :func:`cost_levels`."""
    levels = cost_levels(n, nbytes, inner=inner, outer=outer, group_size=group_size)
    return tuple(float(sum(col)) for col in zip(*levels, strict=True))  # type: ignore[return-value]


hierarchical = register(Algorithm("hierarchical", _build, bytes_sent, summation_depth, cost,
                                  schedule_of(__doc__)))
