"""Trace one all-reduce: who sends which chunk where, tick by tick, drawn and checked.

:func:`trace_all_reduce` runs an algorithm eagerly on one small vector per tower
inside :func:`~towers.allreduce.machinery.primitives.record`, so every
:func:`~towers.allreduce.machinery.primitives.send` becomes a row of the tick table, and
checks the outputs against NumPy. :func:`~towers.trace.draw.draw` turns the rows
into a picture (towers as rows, ticks as columns, one arrow per transfer, one
colour per chunk), :func:`~towers.trace.text.format_table` and
:func:`~towers.trace.text.format_summary` into text; :mod:`towers.trace` exports
all of them::

    tick      0          1          2      │    3          4          5
    tower 0  c3 ─▶1     c2 ─▶1     c1 ─▶1  │   c0 ─▶1 ...          holds c0 c1 c2 c3
    tower 1  c0 ─▶2 ...                 ★c1 finished here (tick 2)

Ticks are the algorithm's own (``send(..., tick=t)``); a transfer without one
gets one by order, and chunk ownership is followed by data flow, both in
:mod:`towers.trace.ticks`. When the chunk labels say a send leaves no later than
its data arrived, the algorithm is traced once more in a ``tf.function`` (not run)
to follow the data each send carries: in a full-buffer exchange both towers send
chunk 0 in one tick, but neither sends what it receives.

Opaque collectives move data outside ``send``: what they report with
``record_estimate`` is shown dashed and marked estimated; if they report nothing,
their registry record's estimated ``bytes_sent``, when they have one, gives one
estimated row per tower into a pseudo-device named ``collective``. What the user
names (a registry name, ``module:NAME``, a callable) is resolved by
:func:`towers.allreduce.machinery.resolve.get`. This module owns the run, the
:class:`Trace` it makes and its JSON form; it re-exports the other two modules' names,
so ``towers.trace.schedule.<name>`` keeps working.

Example:
    >>> trace = trace_all_reduce("ring", devices[:4], size=16)    # doctest: +SKIP
    >>> print(format_table(trace)); draw(trace, "ring.png")        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from towers.allreduce.machinery.base import check_op
from towers.allreduce.machinery.primitives import Transfer, record
from towers.allreduce.machinery.registry import record_of
from towers.allreduce.machinery.resolve import get, is_reducer, label
from towers.devices import canonical_device
from towers.guard.arguments import positive_int
from towers.testing.values import ulp_distance
from towers.trace.loading import start_devices
from towers.trace.ticks import TraceRow, assign_ticks, chunk_ownership

__all__ = [
    "Trace",
    "TraceRow",
    "assign_ticks",
    "chunk_ownership",
    "start_devices",
    "to_json",
    "trace_all_reduce",
    "transfers_from_json",
]

COLLECTIVE = "collective"
"""The pseudo-device that estimated traffic of a silent opaque collective goes to."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one traced all-reduce did; ``places[:towers]`` are the towers' devices."""

    algorithm: str
    places: tuple[str, ...]
    towers: int
    op: str
    size: int
    dtype: str
    transfers: tuple[Transfer, ...]  # as recorded (or estimated), in program order
    rows: tuple[TraceRow, ...]
    finished: dict[int, tuple[int, int]]  # chunk -> (place, tick) where it was first held
    holds: tuple[frozenset[int], ...]  # per place: chunks held complete at the end
    formula: tuple[int, ...] | None  # the algorithm's bytes_sent, if it has one
    max_abs_error: float
    max_ulps: int
    identical: bool  # outputs bitwise identical across towers

    @property
    def ticks(self) -> int:
        """Number of ticks shown (the largest tick + 1; 0 without transfers)."""
        return 1 + max((r.tick for r in self.rows), default=-1)

    @property
    def chunks(self) -> list[int]:
        """The chunk labels followed for ownership (``[0]``: the whole buffer)."""
        return sorted({c for held in self.holds for c in held} | set(self.finished)) or [0]

    @property
    def ok(self) -> bool:
        """True when every output is within ``towers + 2`` ULPs of NumPy's and all agree."""
        return self.identical and self.max_ulps <= self.towers + 2

    @property
    def early(self) -> int:
        """Rows the algorithm placed no later than the tick their data reached their source."""
        return sum(not r.assigned and not r.estimated and r.tick <= r.ready for r in self.rows)

    def place_name(self, p: int) -> str:
        """How place ``p`` is shown: ``tower p`` for a tower, else its device name."""
        return f"tower {p}" if p < self.towers else self.places[p]

    def bytes_sent(self) -> list[int]:
        """Bytes sent per place (unknown sizes count as 0)."""
        out = [0] * len(self.places)
        for r in self.rows:
            out[r.src] += r.nbytes or 0
        return out


# -- running ----------------------------------------------------------------------------------


def _inputs(n: int, size: int) -> list[np.ndarray]:
    """Tower i holds ``i·size + [0, 1, …]``: distinct small integers, so float32 sums are exact."""
    return [(i * size + np.arange(size)).astype(np.float32) for i in range(n)]


def _expected(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays).astype(np.float64)
    return np.asarray(getattr(np, op)(stack, axis=0))  # np.sum, np.mean, np.max, np.min


def _estimates(fn: Any, devices: Sequence[str], nbytes: int) -> list[Transfer]:
    """One estimated row per tower from an estimated record (silent opaque collectives)."""
    configured = record_of(fn)
    if configured is None or not configured.algorithm.estimated or len(devices) < 2:
        return []
    per_tower = configured.bytes_sent(len(devices), nbytes, 4)
    if per_tower is None:
        return []
    return [
        Transfer(d, COLLECTIVE, round(b), tick=0, note="opaque collective", estimated=True)
        for d, b in zip(devices, per_tower)
    ]


def _formula_bytes(fn: Any, n: int, nbytes: int, itemsize: int) -> tuple[int, ...] | None:
    """The record's exact ``bytes_sent`` (None: no record, an estimate, or no formula here)."""
    configured = record_of(fn)
    if configured is None or configured.algorithm.estimated:
        return None
    try:
        value = configured.bytes_sent(n, nbytes, itemsize)
    except Exception:  # a formula for other tower counts: nothing to compare with
        return None
    return None if value is None else tuple(int(v) for v in value)


def _places(transfers: Sequence[Transfer], devices: Sequence[str]) -> list[str]:
    places = [canonical_device(d) for d in devices]
    for t in transfers:
        for device in (t.src, t.dst):
            if device not in places:
                places.append(device)
    return places


def _placed(arrays: list[np.ndarray], devices: Sequence[str]) -> list[Any]:
    import tensorflow as tf

    values = []
    for array, device in zip(arrays, devices):
        with tf.device(device):
            values.append(tf.identity(tf.constant(array)))
    return values


def _run(fn: Any, name: str, devices: Sequence[str], arrays: list[np.ndarray], op: str) -> Any:
    """Run ``fn`` eagerly: ``(results, transfers)``, NumPy outputs and what was recorded."""
    import tensorflow as tf

    values = _placed(arrays, devices)
    with record() as recorder:
        outs = fn(values, op=op)
    if not isinstance(outs, (list, tuple)) or len(outs) != len(values):
        count = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
        raise ValueError(f"{name} returned {count} outputs for {len(values)} towers")
    results = [np.asarray(tf.convert_to_tensor(o).numpy()) for o in outs]
    for i, result in enumerate(results):
        if result.shape != arrays[0].shape:
            raise ValueError(f"{name}: output {i} has shape {result.shape}, not {arrays[0].shape}")
    return results, list(recorder.transfers)


def _follow(
    fn: Any, devices: Sequence[str], arrays: list[np.ndarray], op: str,
    transfers: Sequence[Transfer],
) -> list[frozenset[int] | None] | None:
    """Trace ``fn`` in a ``tf.function`` (not run) to learn what data each send carries.

    Returns:
        Per transfer, the earlier transfers its tensor was computed from
        (``record(follow_data=True)``), or None when the graph made other sends than
        the eager run (data-dependent Python) or could not be traced.
    """
    import tensorflow as tf

    def placed(*args: Any) -> Any:
        values = []
        for arg, device in zip(args, devices):
            with tf.device(device):  # inside the graph each input sits on its tower
                values.append(tf.identity(arg))
        return fn(values, op=op)

    try:
        with record(follow_data=True) as recorder:
            tf.function(placed).get_concrete_function(*_placed(arrays, devices))
    except Exception:  # an algorithm that only runs eagerly: the chunk labels decide
        return None
    same = [dataclasses.astuple(t) for t in recorder.transfers] == [
        dataclasses.astuple(t) for t in transfers]
    return list(recorder.sources) if same else None


def trace_all_reduce(
    algorithm: str | Callable[..., Any],
    devices: Sequence[str],
    *,
    size: int = 16,
    op: str = "sum",
    by_order: bool = False,
    name: str | None = None,
) -> Trace:
    """Run ``algorithm`` once on ``size`` float32 elements per tower and record what it sends.

    Args:
        algorithm: a registry name, ``module:NAME`` or a callable (see
            :func:`towers.allreduce.machinery.resolve.get`).
        devices: one device per tower (e.g. ``towers.simulate_devices(4)``).
        size: elements per tower (tower ``i`` holds ``i·size + [0 … size-1]``).
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        by_order: ignore the algorithm's ticks and assign every tick by order.
        name: what to call it (default: the name ``algorithm`` resolves to).

    Returns:
        The :class:`Trace`: rows, ownership, bytes and the check against NumPy.

    Raises:
        ValueError: a bad ``op`` or ``size``, an unknown algorithm, wrong output count.
    """
    check_op(op)
    positive_int("size", size)
    fn = get(algorithm, argument="algorithm", devices=devices)
    name = name or label(algorithm)
    if is_reducer(fn):
        raise TypeError(f"{name} is a GradientReducer: it reduces a step's gradients all at "
                        "once, so trace a per-tensor algorithm, or see it in `towers timeline`")
    n, arrays = len(devices), _inputs(len(devices), size)
    results, transfers = _run(fn, name, devices, arrays, op)
    whole = size * 4
    transfers = transfers or _estimates(fn, devices, whole)
    places = _places(transfers, devices)
    rows = assign_ticks(transfers, places, whole, by_order=by_order)
    own = rows if not by_order else assign_ticks(transfers, places, whole)
    if any(not r.assigned and not r.estimated and r.tick <= r.ready for r in own):
        sources = _follow(fn, devices, arrays, op, transfers)  # labels say early: ask the data
        if sources is not None:
            rows = assign_ticks(transfers, places, whole, by_order=by_order, sources=sources)
    finished, holds = chunk_ownership(transfers, rows, n, len(places), whole)
    expected = _expected(arrays, op)
    return Trace(
        algorithm=name, places=tuple(places), towers=n, op=op, size=size, dtype="float32",
        transfers=tuple(transfers), rows=tuple(rows), finished=finished, holds=holds,
        formula=_formula_bytes(fn, n, whole, 4),
        max_abs_error=max(float(np.max(np.abs(r - expected))) for r in results),
        max_ulps=max(int(np.max(ulp_distance(r, expected))) for r in results),
        identical=all(r.tobytes() == results[0].tobytes() for r in results),
    )


# -- JSON ----------------------------------------------------------------------------------------


def to_json(trace: Trace) -> dict[str, Any]:
    """A JSON-ready dict: the recorded transfers, the rows as shown, bytes, ownership, result."""
    return {
        "algorithm": trace.algorithm,
        "towers": trace.towers,
        "places": list(trace.places),
        "op": trace.op,
        "size": trace.size,
        "dtype": trace.dtype,
        "ticks": trace.ticks,
        "transfers": [dataclasses.asdict(t) for t in trace.transfers],
        "rows": [dataclasses.asdict(r) for r in trace.rows],
        "bytes_sent": dict(zip(trace.places, trace.bytes_sent())),
        "bytes_sent_formula": None if trace.formula is None else list(trace.formula),
        "finished": {str(c): list(pt) for c, pt in sorted(trace.finished.items())},
        "holds": {trace.places[p]: sorted(h) for p, h in enumerate(trace.holds)},
        "result": {
            "ok": trace.ok,
            "max_abs_error": trace.max_abs_error,
            "max_ulps": trace.max_ulps,
            "identical": trace.identical,
        },
    }


def transfers_from_json(data: dict[str, Any]) -> list[Transfer]:
    """The recorded transfers back from :func:`to_json`'s dict (equal to ``trace.transfers``)."""
    return [Transfer(**t) for t in data["transfers"]]
