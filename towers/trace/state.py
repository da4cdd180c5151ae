"""What every tower holds after every tick: which towers' contributions each chunk carries.

:func:`trace_state` runs an algorithm twice on the same shapes: once through
:func:`~towers.trace.schedule.trace_all_reduce` (the rows, ticks and the check
against NumPy) and once on *labelled* inputs whose sums can be read back. Tower
``i`` holds ``j·2ⁿ + 2ⁱ`` at element ``j``, so any sum of contributions from a set
``S`` of towers is ``|S|·j·2ⁿ + mask(S)``: every element of every tensor the
algorithm sends says which element it is and whose contributions it holds (exact in
float32 while the values stay below 2²⁴). Each send's payload is read as it
crosses devices (an eager op callback on the ``Identity`` that ``send`` places on
the destination), so the state is computed from the data, not from chunk labels::

    element j of tower i:   j·2ⁿ + 2ⁱ            (n = 4, j = 5: 80 + 2ⁱ)
    sum from towers {0, 2}: 2·5·16 + 0b0101 = 165  →  j = 5, holds {0, 2}

A tower's state after tick ``t``: its own contribution plus everything it received
in ticks ``0 … t`` (a receiver combines what it gets). Chunks (segments) are the
element ranges no send splits. An opaque collective (nccl) sends nothing
observable: its one tick goes from the inputs straight to the decoded outputs.

``messages`` counts the α term the way the cost model does (one send and one
receive port per tower; a tick costs its busiest port's messages, several chunks
from one tower to one other in a tick being one message), so it can be held
against the registry record's cost formula.

Example:
    >>> state = trace_state("ring", devices[:4])          # doctest: +SKIP
    >>> state.states[-1][0]     # tower 0 after the last tick: every segment, every tower
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from towers.allreduce.machinery.primitives import record
from towers.allreduce.machinery.registry import record_of
from towers.allreduce.machinery.resolve import get
from towers.devices import canonical_device
from towers.trace.schedule import Trace, trace_all_reduce

__all__ = ["StateTrace", "default_size", "runs", "trace_state"]

Held = tuple[frozenset[int], ...]  # per segment: the towers whose contributions it holds


@dataclasses.dataclass(frozen=True)
class StateTrace:
    """A traced all-reduce with every tower's chunk state before and after each tick."""

    trace: Trace
    segments: tuple[tuple[int, int], ...]  # element ranges [start, stop) no send splits
    carried: tuple[tuple[tuple[int, int], ...], ...]  # per row: element ranges it carries
    states: tuple[tuple[Held, ...], ...]  # states[k][tower]: after tick k - 1 (k = 0: inputs)
    outputs: tuple[Held, ...]  # per tower: what its output holds, decoded
    observed: bool  # False: an opaque collective (state read from the outputs only)
    alpha: float | None  # the record's cost formula's α coefficient (None: no formula)

    @property
    def towers(self) -> int:
        """Number of towers."""
        return self.trace.towers

    @property
    def ticks(self) -> int:
        """Number of ticks (``len(states) - 1``)."""
        return len(self.states) - 1

    @property
    def messages(self) -> int:
        """α counted on the trace: per tick the busiest port's messages, summed."""
        total = 0
        for tick in range(self.trace.ticks):
            ports: dict[tuple[str, int], set[int]] = {}
            for r in self.trace.rows:
                if r.tick == tick and not r.estimated:
                    ports.setdefault(("out", r.src), set()).add(r.dst)
                    ports.setdefault(("in", r.dst), set()).add(r.src)
            total += max((len(peers) for peers in ports.values()), default=0)
        return total

    def complete(self, k: int = -1) -> bool:
        """True when after state ``k`` every tower's every segment holds all contributions."""
        everyone = frozenset(range(self.towers))
        return all(held == everyone for tower in self.states[k] for held in tower)


def default_size(n: int) -> int:
    """Elements per tower for a state trace: ``n`` times the next power of two ≥ ``n``.

    Every registered split divides it: ``n`` chunks (ring), a power of two
    (halving-doubling), rows × columns (torus).
    """
    return n * (1 << max(n - 1, 0).bit_length())


def _labelled(n: int, size: int) -> list[np.ndarray]:
    j = np.arange(size, dtype=np.float64) * (1 << n)
    return [(j + (1 << i)).astype(np.float32) for i in range(n)]


def _decode(values: Any, n: int) -> dict[int, frozenset[int]]:
    """Element index -> contributing towers, for every nonzero element (zeros: padding).

    Raises:
        ValueError: a value no sum of labelled inputs can take (the algorithm scaled or
            transformed what it sent).
    """
    flat = np.rint(np.asarray(values, dtype=np.float64).reshape(-1)).astype(np.int64)
    out: dict[int, frozenset[int]] = {}
    for v in flat[flat != 0]:
        mask = int(v) & ((1 << n) - 1)
        count, rest = bin(mask).count("1"), (int(v) - mask) >> n
        if count == 0 or rest % count:
            raise ValueError(f"a sent value {int(v)} is no sum of labelled contributions")
        out[rest // count] = frozenset(i for i in range(n) if mask >> i & 1)
    return out


def runs(elements: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted element indices as maximal ranges ``[start, stop)``."""
    runs: list[list[int]] = []
    for j in sorted(elements):
        if runs and runs[-1][1] == j:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1])
    return tuple((a, b) for a, b in runs)


def _payloads(
    fn: Callable[..., Any], devices: Sequence[str], arrays: list[np.ndarray]
) -> tuple[list[Any], list[Any], list[Any]]:
    """Run ``fn`` on ``arrays``; returns (transfers, one payload or None per transfer, outputs)."""
    import tensorflow as tf
    from tensorflow.python.framework import op_callbacks

    captured: list[tuple[int, str, str, Any]] = []
    recorder_box: list[Any] = []

    def on_op(op_type: Any, inputs: Any, attrs: Any, outputs: Any, *rest: Any, **kw: Any) -> None:
        name = op_type.decode() if isinstance(op_type, bytes) else op_type
        if name != "Identity" or not recorder_box or not hasattr(outputs[0], "numpy"):
            return
        src, dst = canonical_device(inputs[0].device), canonical_device(outputs[0].device)
        if src != dst:  # `send` logs its transfer right after this copy
            captured.append((len(recorder_box[0].transfers), src, dst, outputs[0].numpy()))

    values = []
    for array, device in zip(arrays, devices):
        with tf.device(device):
            values.append(tf.identity(tf.constant(array)))
    op_callbacks.add_op_callback(on_op)
    try:
        with record() as recorder:
            recorder_box.append(recorder)
            outs = fn(values, op="sum")
    finally:
        op_callbacks.remove_op_callback(on_op)
    transfers = list(recorder.transfers)
    payloads: list[Any] = [None] * len(transfers)
    for index, src, dst, value in captured:
        if index < len(transfers) and (transfers[index].src, transfers[index].dst) == (src, dst):
            payloads[index] = value
    return transfers, payloads, [np.asarray(tf.convert_to_tensor(o).numpy()) for o in outs]


def _segments(size: int, carried: Sequence[tuple[tuple[int, int], ...]]) -> list[tuple[int, int]]:
    cuts = {0, size}
    for ranges in carried:
        for a, b in ranges:
            cuts |= {a, b}
    edges = sorted(c for c in cuts if 0 <= c <= size)
    return list(itertools.pairwise(edges))


def _held(per_element: Sequence[frozenset[int]], segments: Sequence[tuple[int, int]]) -> Held:
    """Per segment: the contributions every element of it holds."""
    return tuple(frozenset.intersection(*per_element[a:b]) for a, b in segments)


def _states(
    trace: Trace, masks: list[dict[int, frozenset[int]]], size: int,
    segments: Sequence[tuple[int, int]],
) -> list[tuple[Held, ...]]:
    n = trace.towers
    now = [[frozenset({p}) for _ in range(size)] for p in range(len(trace.places))]
    out = [tuple(_held(now[p], segments) for p in range(n))]
    for tick in range(trace.ticks):
        for r, mask in zip(trace.rows, masks):
            if r.tick == tick:
                for j, held in mask.items():
                    now[r.dst][j] = now[r.dst][j] | held
        out.append(tuple(_held(now[p], segments) for p in range(n)))
    return out


def _alpha(fn: Any, n: int, nbytes: int) -> float | None:
    configured = record_of(fn)
    if configured is None or configured.algorithm.cost is None:
        return None
    try:
        return float(configured.algorithm.cost(n, nbytes, **configured.params)[0])
    except Exception:  # a formula that does not cover this n: nothing to compare
        return None


def trace_state(
    algorithm: str | Callable[..., Any], devices: Sequence[str], *, size: int | None = None
) -> StateTrace:
    """Trace ``algorithm`` (op ``sum``) and compute every tower's chunk state per tick.

    Args:
        algorithm: a registry name, ``module:NAME`` or a callable.
        devices: one device per tower (at most 24 towers: the labels must stay exact).
        size: elements per tower (default :func:`default_size`).

    Returns:
        The :class:`StateTrace`.

    Raises:
        ValueError: more than 24 towers, a nondeterministic schedule, or sends that are no
            sums of contributions.
    """
    n = len(devices)
    size = size or default_size(n)
    if n > 24 or size * n << n >= 1 << 24:
        raise ValueError(f"devices: a state trace labels {n} towers × {size} elements exactly "
                         "only while size·n·2ⁿ < 2²⁴ (at most 8 towers at the default size)")
    trace = trace_all_reduce(algorithm, devices, size=size, op="sum")
    fn = get(algorithm, argument="algorithm", devices=devices)
    transfers, payloads, outputs = _payloads(fn, devices, _labelled(n, size))
    if [(t.src, t.dst, t.nbytes) for t in transfers] != [
        (t.src, t.dst, t.nbytes) for t in trace.transfers
    ]:
        raise ValueError(f"{trace.algorithm} sent differently on a second run: not traceable")
    masks = [{} if p is None or t.estimated else _decode(p, n)
             for t, p in zip(transfers, payloads)]
    carried = [runs(list(m)) for m in masks]
    segments = _segments(size, carried)
    out_held = tuple(_held([d.get(j, frozenset()) for j in range(size)], segments)
                     for d in (_decode(o, n) for o in outputs))
    observed = any(masks) or not trace.rows
    states = _states(trace, masks, size, segments) if observed else [
        tuple(tuple(frozenset({p}) for _ in segments) for p in range(n)), out_held]
    return StateTrace(trace, tuple(segments), tuple(carried), tuple(states), out_held,
                      observed, _alpha(fn, n, size * 4))
