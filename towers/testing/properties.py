"""One example of an all-reduce checked: outputs, value bound, agreement, bytes, replay."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

from towers.allreduce.machinery.primitives import Recorder, record
from towers.allreduce.machinery.registry import algorithm_name, record_of
from towers.devices import canonical_device
from towers.testing.bounds import sum_bound, summation_depth
from towers.testing.replay import ReplayError, place, replay
from towers.testing.values import assert_close, is_float, tower_values

__all__ = ["Case", "cases", "check_case", "describe", "replay_refusal", "unchecked"]


class Case(NamedTuple):
    """One example: ``n`` towers, their arrays, the op."""

    n: int
    arrays: list[np.ndarray]
    op: str


@st.composite
def cases(draw: st.DrawFn, n: int, dtypes: Sequence[tf.DType], ops: Sequence[str],
          shapes: Any) -> Case:
    """Examples with exactly ``n`` towers."""
    _, arrays = draw(tower_values(n, dtypes, shapes, min_towers=n))
    is_int = not is_float(arrays[0].dtype)
    return Case(n, arrays, draw(st.sampled_from([o for o in ops if not (is_int and o == "mean")])))


def unchecked(fn: Any) -> list[str]:
    """Which properties cannot be checked for ``fn`` and why (no record, no formula, estimates)."""
    configured, name = record_of(fn), algorithm_name(fn)
    if configured is None:
        return [f"bytes not checked: {name} has no registry record (register(Algorithm(...)) "
                "gives it bytes_sent and summation_depth)",
                "bound uses depth n-1: no registry record with a summation_depth(n)"]
    notes = []
    if configured.algorithm.estimated:
        notes.append(f"bytes not checked: {name}'s bytes_sent is an estimate (opaque collectives)")
    elif configured.algorithm.bytes_sent is None:
        notes.append(f"bytes not checked: {name}'s record has no bytes_sent")
    if configured.algorithm.summation_depth is None:
        notes.append(f"bound uses depth n-1: {name}'s record has no summation_depth")
    return notes


def replay_refusal(fn: Any) -> str | None:
    """Why ``fn`` cannot be replayed, known before trying (its record says so), or None."""
    configured = record_of(fn)
    if configured is None or configured.algorithm.replayable:
        return None
    why = " (opaque collective ops: the runtime moves and adds the data)"
    return (f"replay impossible: {configured.name} is not replayable"
            f"{why if configured.algorithm.estimated else ''}")


def _check_outputs(outs: Any, case: Case, devices: Sequence[str]) -> list[str]:
    """Count, type, shape, dtype and placement of the outputs."""
    if not isinstance(outs, (list, tuple)) or len(outs) != case.n:
        count = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
        return [f"returned {count} outputs for {case.n} towers"]
    want_dtype, want_shape = tf.as_dtype(case.arrays[0].dtype), case.arrays[0].shape
    failures = []
    for i, out in enumerate(outs):
        if not isinstance(out, (tf.Tensor, tf.Variable)):
            failures.append(f"output {i} is a {type(out).__name__}, not a tf.Tensor")
        elif out.dtype != want_dtype or tuple(out.shape) != want_shape:
            failures.append(f"output {i} is {out.dtype.name}{list(out.shape)}, "
                            f"expected {want_dtype.name}{list(want_shape)}")  # fmt: skip
        elif canonical_device(out.device) != canonical_device(devices[i]):
            failures.append(f"output {i} is on {canonical_device(out.device)}, but input {i} "
                            f"is on {canonical_device(devices[i])}")  # fmt: skip
    return failures


def _bitwise(actual: np.ndarray, expected: np.ndarray, what: str) -> str | None:
    """None when bitwise equal; else what differs (values, or only signs of zero)."""
    if actual.tobytes() == np.asarray(expected).tobytes():
        return None
    try:
        assert_close(actual, expected, what=what)
    except AssertionError as err:
        return str(err)
    return f"{what}: equal values but different bits (signed zeros or NaN payloads)"


def _check_values(results: list[np.ndarray], case: Case, depth: int) -> list[str]:
    """The bound, and bitwise agreement."""
    expected, tol = sum_bound(case.arrays, case.op, depth)
    failures = []
    for i, result in enumerate(results):
        try:
            assert_close(result, expected, atol=tol, what=f"output {i}")
        except AssertionError as err:
            bound = f"bound γ_k·Σ|x| with summation depth {depth}" if tol.any() else "exact"
            failures.append(f"{err} [{bound}]")
    for i, result in enumerate(results[1:], start=1):
        diff = _bitwise(result, results[0], f"output {i} vs output 0")
        if diff:
            failures.append(f"outputs are not bitwise identical: {diff}")
    return failures


def _check_bytes(fn: Any, rec: Recorder, case: Case, devices: Sequence[str]) -> list[str]:
    """Bytes each tower sent against the record's exact ``bytes_sent`` formula."""
    configured = record_of(fn)
    if configured is None or configured.algorithm.estimated:
        return []
    itemsize = case.arrays[0].dtype.itemsize
    nbytes = case.arrays[0].size * itemsize
    expected = configured.bytes_sent(case.n, nbytes, itemsize)
    if expected is None:
        return []
    sent = rec.bytes_sent()
    got = [sent.get(canonical_device(d), 0) for d in devices[: case.n]]
    if got == expected:
        return []
    unseen = ("" if rec.transfers else " (nothing was sent with towers.allreduce.send: "
              "move data with send so it is counted, or register the record with "
              "estimated=True)")  # fmt: skip
    return [f"bytes sent per tower {got} differ from bytes_sent(n={case.n}, nbytes={nbytes}, "
            f"itemsize={itemsize}) = {expected}{unseen}"]  # fmt: skip


def _check_replay(fn: Any, results: list[np.ndarray], case: Case, devices: Sequence[str]
                  ) -> list[str]:
    """Bitwise equal to the NumPy replay; a replay that cannot run is a failure."""
    refused = replay_refusal(fn)
    if refused:
        return [refused]
    try:
        replayed = replay(fn, case.arrays, case.op, devices=devices[: case.n])
    except ReplayError as err:
        return [f"replay impossible: {err}"]
    except Exception as err:
        return [f"tracing it in a tf.function for replay raised {type(err).__name__}: {err}"]
    diffs = [_bitwise(result, np.asarray(again), f"output {i} vs its NumPy replay")
             for i, (result, again) in enumerate(zip(results, replayed, strict=False))]
    return [d for d in diffs if d]


def check_case(fn: Any, case: Case, devices: Sequence[str], replay: bool) -> list[str]:
    """Run ``fn`` on one example and return every failed property (empty: all held)."""
    placed = list(devices[: case.n])
    try:
        values = place(case.arrays, placed)
        with record() as rec:
            outs = fn(values, op=case.op)
    except Exception as err:
        return [f"raised {type(err).__name__}: {err}"]
    failures = _check_outputs(outs, case, placed)
    if failures:
        return failures
    results = [np.asarray(out.numpy()) for out in outs]
    try:
        depth = summation_depth(fn, case.n)
        failures = _check_values(results, case, depth) + _check_bytes(fn, rec, case, placed)
    except Exception as err:  # a formula that fails is the algorithm's failure too
        return [f"a summation_depth/bytes_sent formula raised {type(err).__name__}: {err}"]
    return failures + (_check_replay(fn, results, case, placed) if replay else [])


def describe(case: Case, devices: Sequence[str]) -> str:
    first = case.arrays[0]
    lines = [f"n={case.n} towers, shape={first.shape}, dtype={first.dtype.name}, op={case.op!r}"]
    for i, a in enumerate(case.arrays):
        shown = a.astype(np.float32) if a.dtype.name == "bfloat16" else a
        text = np.array2string(shown, threshold=24, floatmode="unique", separator=", ")
        lines.append(f"  values[{i}] on {canonical_device(devices[i])}: {text}")
    return "\n".join(lines)
