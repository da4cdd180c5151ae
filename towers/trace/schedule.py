"""Trace one all-reduce: who sends which chunk where, tick by tick, drawn and checked.

:func:`trace_all_reduce` runs an algorithm eagerly on one small vector per tower
inside :func:`~towers.allreduce.primitives.record`, so every
:func:`~towers.allreduce.primitives.send` becomes a row of the tick table, and
checks the outputs against NumPy. :func:`~towers.trace.draw.draw` turns the rows
into a picture (towers as rows, ticks as columns, one arrow per transfer, one
colour per chunk), :func:`~towers.trace.text.format_table` and
:func:`~towers.trace.text.format_summary` into text; :mod:`towers.trace` exports
all of them::

    tick      0          1          2      │    3          4          5
    tower 0  c3 ─▶1     c2 ─▶1     c1 ─▶1  │   c0 ─▶1 ...          holds c0 c1 c2 c3
    tower 1  c0 ─▶2 ...                 ★c1 finished here (tick 2)

Ticks are the algorithm's own (``send(..., tick=t)``). A transfer without one
gets one **by order**: one tick after the later of its source's previous send,
its destination's previous receive and the last receive at its source of a
chunk it carries (one send and one receive per device per tick, the
single-port model of :mod:`towers.bench.costmodel`, and never before its data
can exist). Opaque collectives move data outside ``send``: what they report
with ``record_estimate`` is shown dashed and marked estimated; if they report
nothing, their registry record's estimated ``bytes_sent``, when they have one,
gives one estimated row per tower into a pseudo-device named ``collective``.

Chunk ownership is followed by data flow over the rows in program order: a
transfer with chunk label ``c`` of ``b`` bytes carries chunks ``c .. c + b/u - 1``
(``u``: the smallest labelled piece); a transfer without a label, or of the
whole buffer, carries every chunk. A receiver is assumed to combine what it
gets, so a tower *holds* chunk ``c`` once contributions from every tower could
have reached it; the first tower to hold it *finished* it. The values are
checked separately against NumPy.

Example:
    >>> trace = trace_all_reduce("ring", devices[:4], size=16)    # doctest: +SKIP
    >>> print(format_table(trace)); draw(trace, "ring.png")        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from towers.allreduce.recording import Transfer

__all__ = [
    "Trace",
    "TraceRow",
    "assign_ticks",
    "chunk_ownership",
    "load_algorithm",
    "start_devices",
    "to_json",
    "trace_all_reduce",
    "transfers_from_json",
]

COLLECTIVE = "collective"
"""The pseudo-device that estimated traffic of a silent opaque collective goes to."""


@dataclasses.dataclass(frozen=True)
class TraceRow:
    """One transfer as shown: places are indices into :attr:`Trace.places`."""

    tick: int
    src: int
    dst: int
    chunk: int | None
    nbytes: int | None
    note: str
    estimated: bool = False
    assigned: bool = False  # the tick was given by order, not by the algorithm
    ready: int = -1  # the tick its data reached its source (-1: the source's own input)


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


# -- devices and algorithms ----------------------------------------------------------------------


def start_devices(n: int) -> list[str]:
    """``towers.simulate_devices(n)``, or the first ``n`` devices if TensorFlow already runs.

    Raises:
        RuntimeError: TensorFlow already started with fewer than ``n`` devices.
    """
    import towers

    try:
        return towers.simulate_devices(n)
    except RuntimeError:
        have = towers.local_devices()
        if len(have) < n:
            raise
        return have[:n]


def _import(module: str, attr: str) -> Any:
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
    if not callable(obj) and not _is_reducer(obj):
        raise TypeError(f"{module}:{attr} is a {type(obj).__name__}, not a callable")
    return obj


def _is_reducer(obj: Any) -> bool:
    """A :class:`~towers.allreduce.base.GradientReducer` (all gradients at once)?"""
    from towers.allreduce.base import GradientReducer

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

    from towers.allreduce.recording import record

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
    from towers.allreduce import get
    from towers.allreduce.registry import algorithm_name

    if isinstance(spec, str) and ":" not in spec:
        try:
            return spec, get(spec)
        except ValueError as err:
            raise ValueError(f"{err}; or name your own as module:function") from None
    name = spec if isinstance(spec, str) else algorithm_name(spec)
    if isinstance(spec, str) and spec.rsplit(":", 1)[0].endswith(".py"):
        name = Path(spec).name  # my_algos.py:star, not the whole path
    obj = _import(*spec.rsplit(":", 1)) if isinstance(spec, str) else spec
    if _is_reducer(obj) or _is_algorithm(obj, devices):
        return name, obj
    made = obj()
    if not callable(made) and not _is_reducer(made):
        raise TypeError(f"{name} is neither an all-reduce nor a factory of one: gave {made!r}")
    return name, made


# -- running and scheduling ----------------------------------------------------------------------


def _inputs(n: int, size: int) -> list[np.ndarray]:
    """Tower i holds ``i·size + [0, 1, …]``: distinct small integers, so float32 sums are exact."""
    return [(i * size + np.arange(size)).astype(np.float32) for i in range(n)]


def _expected(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays).astype(np.float64)
    return np.asarray(getattr(np, op)(stack, axis=0))  # np.sum, np.mean, np.max, np.min


def _estimates(fn: Any, devices: Sequence[str], nbytes: int) -> list[Transfer]:
    """One estimated row per tower from an estimated record (silent opaque collectives)."""
    from towers.allreduce.registry import record_of

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
    from towers.allreduce.registry import record_of

    configured = record_of(fn)
    if configured is None or configured.algorithm.estimated:
        return None
    try:
        value = configured.bytes_sent(n, nbytes, itemsize)
    except Exception:  # a formula for other tower counts: nothing to compare with
        return None
    return None if value is None else tuple(int(v) for v in value)


def _places(transfers: Sequence[Transfer], devices: Sequence[str]) -> list[str]:
    from towers.devices import canonical_device

    places = [canonical_device(d) for d in devices]
    for t in transfers:
        for device in (t.src, t.dst):
            if device not in places:
                places.append(device)
    return places


def _covered(
    chunk: int | None, nbytes: int | None, whole: int, unit: int, labels: list[int]
) -> list[int]:
    """The chunk labels a transfer carries (see the module docstring)."""
    if chunk is None or nbytes is None or nbytes >= whole or not unit:
        return labels
    span = max(1, round(nbytes / unit))
    return [c for c in range(chunk, chunk + span) if c in labels] or [chunk]


def _labels(transfers: Sequence[Transfer], whole: int) -> tuple[list[int], int]:
    """The chunk labels of partial transfers and the smallest labelled piece's size."""
    pieces = [t for t in transfers if t.chunk is not None and t.nbytes and t.nbytes < whole]
    labels = sorted({t.chunk for t in pieces if t.chunk is not None})
    return labels or [0], min((t.nbytes or 0 for t in pieces), default=0)


def assign_ticks(
    transfers: Sequence[Transfer], places: Sequence[str], whole: int, *, by_order: bool = False
) -> list[TraceRow]:
    """Rows with a tick each: the algorithm's, or (``tick=None``, or ``by_order``) by order.

    By order, a transfer goes one tick after the latest of: its source's previous
    send, its destination's previous receive, and its source's last receive of a
    chunk it carries (``whole``: the bytes of one tower's buffer, see the module
    docstring for what a transfer carries).
    """
    labels, unit = _labels(transfers, whole)
    last_send, last_recv = [-1] * len(places), [-1] * len(places)
    got: list[dict[int, int]] = [{} for _ in places]
    rows = []
    for t in transfers:
        s, d = places.index(t.src), places.index(t.dst)
        # Estimated rows sum up a whole opaque collective: they wait for no data.
        carried = [] if t.estimated else _covered(t.chunk, t.nbytes, whole, unit, labels)
        ready = max((got[s].get(c, -1) for c in carried), default=-1)
        assigned = t.tick is None or by_order
        tick = 1 + max(last_send[s], last_recv[d], ready) if assigned else int(t.tick or 0)
        last_send[s], last_recv[d] = max(last_send[s], tick), max(last_recv[d], tick)
        for c in carried:
            got[d][c] = max(got[d].get(c, -1), tick)
        rows.append(TraceRow(tick, s, d, t.chunk, t.nbytes, t.note, t.estimated, assigned, ready))
    return rows


def chunk_ownership(
    transfers: Sequence[Transfer], rows: Sequence[TraceRow], towers: int, places: int, whole: int
) -> tuple[dict[int, tuple[int, int]], tuple[frozenset[int], ...]]:
    """Follow each chunk's contributions through the rows in program order.

    Returns:
        ``(finished, holds)``: ``finished[chunk] = (place, tick)`` where the chunk first
        held every tower's contribution, and per place the chunks it holds complete at
        the end. Estimated rows carry no data here; when every row is estimated the
        ownership is not observable and ``holds`` is empty.
    """
    if towers > 1 and all(r.estimated for r in rows):
        return {}, ()
    labels, unit = _labels(transfers, whole)
    everyone = set(range(towers))
    state = [{c: {p} if p < towers else set() for c in labels} for p in range(places)]
    finished: dict[int, tuple[int, int]] = {}
    for r in rows:
        if r.estimated:
            continue
        for c in _covered(r.chunk, r.nbytes, whole, unit, labels):
            state[r.dst][c] |= state[r.src][c]
            if c not in finished and state[r.dst][c] >= everyone:
                finished[c] = (r.dst, r.tick)
    holds = tuple(frozenset(c for c in labels if state[p][c] >= everyone) for p in range(places))
    return finished, holds


def _run(fn: Any, name: str, devices: Sequence[str], arrays: list[np.ndarray], op: str) -> Any:
    import tensorflow as tf

    from towers.allreduce.recording import record

    values = []
    for array, device in zip(arrays, devices):
        with tf.device(device):
            values.append(tf.identity(tf.constant(array)))
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
        algorithm: a registry name, ``module:function`` or a callable (see
            :func:`load_algorithm`).
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
    from towers.allreduce.base import check_op
    from towers.testing.values import ulp_distance

    check_op(op)
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    resolved, fn = load_algorithm(algorithm, devices)
    name = name or resolved
    if _is_reducer(fn):
        raise TypeError(f"{name} is a GradientReducer: it reduces a step's gradients all at "
                        "once, so trace a per-tensor algorithm, or see it in `towers timeline`")
    n, arrays = len(devices), _inputs(len(devices), size)
    results, transfers = _run(fn, name, devices, arrays, op)
    whole = size * 4
    transfers = transfers or _estimates(fn, devices, whole)
    places = _places(transfers, devices)
    rows = assign_ticks(transfers, places, whole, by_order=by_order)
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
