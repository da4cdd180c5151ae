"""Trace one all-reduce: every ``send`` recorded as a row of the tick table, checked against NumPy.

When the chunk labels say a send leaves before its data arrived, the algorithm is traced
again in a ``tf.function`` to follow the data each send carries. An opaque collective's
estimated ``bytes_sent`` gives one dashed row per tower into the pseudo-device ``collective``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from towers.allreduce.machinery.base import check_op
from towers.allreduce.machinery.primitives import Transfer, record
from towers.allreduce.machinery.registry import record_of
from towers.allreduce.machinery.resolve import get, is_reducer, label
from towers.devices import canonical_device, local_devices, simulate_devices
from towers.guard.arguments import positive_int
from towers.testing.replay import place
from towers.testing.values import ulp_distance
from towers.trace.table import Trace, assign_ticks, chunk_ownership

__all__ = ["COLLECTIVE", "record_formula", "resolve", "run_trace", "start_devices", "to_json",
           "trace_all_reduce"]

COLLECTIVE = "collective"
"""The pseudo-device that estimated traffic of a silent opaque collective goes to."""


def start_devices(n: int) -> list[str]:
    """``towers.simulate_devices(n)``, or the first ``n`` devices if TensorFlow already runs
    (``RuntimeError``: it runs with fewer)."""
    try:
        return simulate_devices(n)
    except RuntimeError:
        have = local_devices()
        if len(have) < n:
            raise
        return have[:n]


def record_formula(fn: Any, formula: Callable[[Any], Any]) -> Any:
    """``formula(record)`` of ``fn``'s registry record; None without a record, or when the
    formula does not cover this case (another tower count: nothing to compare with)."""
    configured = record_of(fn)
    try:
        return None if configured is None else formula(configured)
    except Exception:
        return None


def _run(fn: Any, name: str, devices: Sequence[str], arrays: list[np.ndarray], op: str,
         payloads: bool) -> tuple[list[np.ndarray], list[Transfer], list[Any]]:
    """Run ``fn`` eagerly: NumPy outputs, the transfers and (``payloads``) what each carried,
    read from the ``Identity`` that ``send`` places on the destination."""
    captured: list[tuple[int, str, str, Any]] = []

    def on_op(op_type: Any, inputs: Any, attrs: Any, outputs: Any, *rest: Any, **kw: Any) -> None:
        kind = op_type.decode() if isinstance(op_type, bytes) else op_type
        if kind == "Identity" and hasattr(outputs[0], "numpy"):
            src, dst = canonical_device(inputs[0].device), canonical_device(outputs[0].device)
            if src != dst:  # `send` logs its transfer right after this copy
                captured.append((len(recorder.transfers), src, dst, outputs[0].numpy()))

    values = place(arrays, devices)
    with record() as recorder:
        if payloads:
            op_callbacks.add_op_callback(on_op)
        try:
            outs = fn(values, op=op)
        finally:
            if payloads:
                op_callbacks.remove_op_callback(on_op)
    if not isinstance(outs, (list, tuple)) or len(outs) != len(values):
        count = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
        raise ValueError(f"{name} returned {count} outputs for {len(values)} towers")
    results = [np.asarray(tf.convert_to_tensor(o).numpy()) for o in outs]
    for i, result in enumerate(results):
        if result.shape != arrays[0].shape:
            raise ValueError(f"{name}: output {i} has shape {result.shape}, not {arrays[0].shape}")
    transfers = list(recorder.transfers)
    carried: list[Any] = [None] * len(transfers)
    for index, src, dst, value in captured:
        if index < len(transfers) and (transfers[index].src, transfers[index].dst) == (src, dst):
            carried[index] = value
    return results, transfers, carried


def _follow(fn: Any, devices: Sequence[str], arrays: list[np.ndarray], op: str,
            transfers: Sequence[Transfer]) -> list[frozenset[int] | None] | None:
    """Per transfer, the earlier transfers its tensor was computed from, learned by tracing
    ``fn`` in a ``tf.function``; None when the graph sends differently or cannot be traced."""
    try:
        with record(follow_data=True) as recorder:
            tf.function(lambda *args: fn(place(args, devices), op=op)).get_concrete_function(
                *place(arrays, devices))
    except Exception:  # an algorithm that only runs eagerly: the chunk labels decide
        return None
    same = list(recorder.transfers) == list(transfers)
    return list(recorder.sources) if same else None


def run_trace(fn: Any, devices: Sequence[str], arrays: list[np.ndarray], *, op: str, name: str,
              by_order: bool = False, payloads: bool = False
              ) -> tuple[Trace, list[Any], list[np.ndarray]]:
    """Trace ``fn`` on ``arrays`` (one per tower): the :class:`Trace`, what each transfer
    carried (``payloads``; else None) and the outputs."""
    n, size, whole = len(devices), arrays[0].size, arrays[0].size * 4
    results, transfers, carried = _run(fn, name, devices, arrays, op, payloads)
    formula = record_formula(fn, lambda r: r.bytes_sent(n, whole, 4))
    estimated = bool(record_formula(fn, lambda r: r.algorithm.estimated))
    if not transfers and estimated and formula and n > 1:
        transfers = [Transfer(d, COLLECTIVE, round(b), tick=0, note="opaque collective",
                              estimated=True) for d, b in zip(devices, formula)]
        carried = [None] * len(transfers)
    places = [canonical_device(d) for d in devices]
    places += list(dict.fromkeys(d for t in transfers for d in (t.src, t.dst) if d not in places))
    rows = assign_ticks(transfers, places, whole, by_order=by_order)
    own = rows if not by_order else assign_ticks(transfers, places, whole)
    if any(not r.assigned and not r.estimated and r.tick <= r.ready for r in own):
        sources = _follow(fn, devices, arrays, op, transfers)  # labels say early: ask the data
        if sources is not None:
            rows = assign_ticks(transfers, places, whole, by_order=by_order, sources=sources)
    finished, holds = chunk_ownership(transfers, rows, n, len(places), whole)
    expected = np.asarray(getattr(np, op)(np.stack(arrays).astype(np.float64), axis=0))
    return Trace(
        algorithm=name, places=tuple(places), towers=n, op=op, size=size, dtype="float32",
        transfers=tuple(transfers), rows=tuple(rows), finished=finished, holds=holds,
        formula=None if estimated or formula is None else tuple(int(v) for v in formula),
        max_abs_error=max(float(np.max(np.abs(r - expected))) for r in results),
        max_ulps=max(int(np.max(ulp_distance(r, expected))) for r in results),
        identical=all(r.tobytes() == results[0].tobytes() for r in results),
    ), carried, results


def resolve(algorithm: str | Callable[..., Any], devices: Sequence[str]) -> Any:
    """The per-tensor all-reduce ``algorithm`` names (``TypeError``: a ``GradientReducer``)."""
    fn = get(algorithm, argument="algorithm", devices=devices)
    if is_reducer(fn):
        raise TypeError(f"{label(algorithm)} is a GradientReducer: it reduces a step's "
                        "gradients all at once, so trace a per-tensor algorithm, or see it in "
                        "`towers timeline`")
    return fn


def trace_all_reduce(algorithm: str | Callable[..., Any], devices: Sequence[str], *,
                     size: int = 16, op: str = "sum", by_order: bool = False,
                     name: str | None = None) -> Trace:
    """Run ``algorithm`` (a registry name, ``module:NAME`` or a callable) once on ``size``
    float32 elements per tower (tower ``i`` holds ``i·size + [0 … size-1]``: exact sums) and
    record what it sends; ``by_order``: ignore the algorithm's ticks, assign all by order.

    Raises:
        ValueError: a bad ``op`` or ``size``, an unknown algorithm, wrong output count.
    """
    check_op(op)
    positive_int("size", size)
    fn = resolve(algorithm, devices)
    arrays = [(i * size + np.arange(size)).astype(np.float32) for i in range(len(devices))]
    return run_trace(fn, devices, arrays, op=op, name=name or label(algorithm),
                     by_order=by_order)[0]


def to_json(trace: Trace) -> dict[str, Any]:
    """A JSON-ready dict: the transfers, the rows as shown, bytes, ownership, result."""
    return {
        **{k: getattr(trace, k) for k in ("algorithm", "towers", "op", "size", "dtype", "ticks")},
        "places": list(trace.places),
        "transfers": [dataclasses.asdict(t) for t in trace.transfers],
        "rows": [dataclasses.asdict(r) for r in trace.rows],
        "bytes_sent": dict(zip(trace.places, trace.bytes_sent())),
        "bytes_sent_formula": None if trace.formula is None else list(trace.formula),
        "finished": {str(c): list(pt) for c, pt in sorted(trace.finished.items())},
        "holds": {trace.places[p]: sorted(h) for p, h in enumerate(trace.holds)},
        "result": {k: getattr(trace, k) for k in ("ok", "max_abs_error", "max_ulps", "identical")},
    }
