"""``check_all_reduce``: any all-reduce against the contract, searched with Hypothesis per
tower count, then stratified examples; the report says what failed, on the smallest example."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from towers.allreduce.machinery.base import DTYPES, OPS, AllReduce
from towers.allreduce.machinery.registry import algorithm_name
from towers.allreduce.machinery.resolve import get
from towers.devices import local_devices
from towers.guard.arguments import positive_int
from towers.testing.properties import Case, cases, check_case, describe, replay_refusal, unchecked

__all__ = ["CheckReport", "check_all_reduce", "stratified", "verdict"]

@dataclasses.dataclass(frozen=True, repr=False)
class CheckReport:
    """What :func:`check_all_reduce` found; ``bool`` is ``ok``, ``str`` and ``repr`` the verdict."""

    algorithm: str
    ok: bool
    examples: int
    failures: tuple[str, ...] = ()
    example: str | None = None
    notes: tuple[str, ...] = ()
    stratified: int = 0

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        strata = (f"plus {self.stratified} stratified examples: every (tower count, op) pair, "
                  "and a scalar and an empty tensor at every tower count",
                  ) if self.stratified else ()
        return verdict(self.ok, f"{self.algorithm} ({self.examples} examples run)",
                       (*self.notes, *strata), self.failures, self.example)

    __repr__ = __str__


def verdict(ok: bool, what: str, notes: Sequence[str], failures: Sequence[str],
            example: str | None = None) -> str:  # fmt: skip
    """A checker's report as text: PASS or FAIL, the notes, the example, the failures."""
    lines = [f"{'PASS' if ok else 'FAIL'}: {what}", *(f"  note: {note}" for note in notes)]
    if example is not None:
        lines += ["Smallest failing example:", example]
    if failures:
        lines += ["Failures:", *(f"  - {f}" for f in failures)]
    return "\n".join(lines)


def stratified(n: int, dtypes: Sequence[tf.DType], ops: Sequence[str], seed: int = 0
               ) -> list[Case]:
    """One example per op at ``n`` towers (``2n + 1`` elements of the first float dtype,
    float32 first; magnitudes in [1, 2^10), both signs), and a scalar and an empty tensor."""
    rng = np.random.default_rng([seed, n])
    floats = sorted((d for d in dtypes if d.is_floating), key=lambda d: d != tf.float32)
    out = []
    shape = (2 * n + 1,)
    for op in (o for o in ops if floats or o != "mean"):
        dtype = floats[0] if floats else dtypes[0]
        draw = [rng.choice([-1.0, 1.0], shape) * rng.uniform(1, 2**10, shape) if floats
                else rng.integers(-(2**10), 2**10, shape) for _ in range(n)]  # fmt: skip
        out.append(Case(n, [np.asarray(a).astype(dtype.as_numpy_dtype) for a in draw], op))
    edge = floats[0] if floats else dtypes[0]
    op = "sum" if "sum" in ops else ops[0]
    for edge_shape in ((), (0,)):  # a scalar and an empty tensor, whatever the draw gives
        out.append(Case(n, [np.full(edge_shape, t + 1, edge.as_numpy_dtype) for t in range(n)], op))
    return out


class _Failed(AssertionError):
    def __init__(self, example: str, failures: list[str]) -> None:
        super().__init__(example + "\n" + "\n".join(failures))
        self.example, self.failures = example, failures


def _search(algorithm: Any, n: int, examples: int, cases: st.SearchStrategy[Case],
            devices: list[str], replay: bool, seed: int | None) -> tuple[int, _Failed | None]:
    """One Hypothesis search at ``n`` towers: (examples run, the shrunk failure or None)."""
    runs = [0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet,
              phases=(Phase.explicit, Phase.generate, Phase.shrink),
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(cases)
    def prop(case: Case) -> None:
        runs[0] += 1
        failures = check_case(algorithm, case, devices, replay)
        if failures:
            raise _Failed(describe(case, devices), failures)

    try:
        (prop if seed is None else hypothesis_seed(seed + n)(prop))()
    except _Failed as failed:
        return runs[0], failed
    except Exception as err:  # Hypothesis itself gave up (a flaky algorithm, ...)
        return runs[0], _Failed(f"n={n} towers (no example kept)", [f"{type(err).__name__}: {err}"])
    return runs[0], None


def _options(max_towers: Any, ops: Any, dtypes: Any) -> tuple[list[str], list[tf.DType]]:
    """The caller's options, checked: a bad one must not read as the algorithm's failure."""
    positive_int("max_towers", max_towers)
    ops = [ops] if isinstance(ops, str) else list(ops)
    bad_ops = [o for o in ops if o not in OPS]
    if bad_ops:
        raise ValueError(f"ops: unknown {bad_ops}; choose from {', '.join(OPS)}")
    dtypes = [dtypes] if isinstance(dtypes, (str, tf.DType)) else list(dtypes)
    dtypes = [tf.as_dtype(d) for d in dtypes]
    bad_dtypes = [d.name for d in dtypes if d not in DTYPES]
    if bad_dtypes:
        raise ValueError(f"dtypes: {bad_dtypes} not supported; choose from "
                         f"{', '.join(d.name for d in DTYPES)}")
    return ops, dtypes


def check_all_reduce(
    fn: AllReduce | str, *, max_towers: int = 8, dtypes: Sequence[Any] = DTYPES,
    ops: Sequence[str] = OPS,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[tuple[int, ...]] | None = None,
    max_examples: int | None = None, devices: Sequence[str] | None = None,
    seed: int | None = 0, replay: bool = False, tower_counts: Sequence[int] | None = None,
) -> CheckReport:
    """Run Hypothesis over towers (ascending: the first failure has the fewest), shapes,
    dtypes and ops on ``fn`` (a callable or a registry name); report every broken promise.

    Args:
        max_towers, tower_counts: the counts to check (default ``1..max_towers``).
        dtypes, ops, shapes: what to draw (default: all the contract supports).
        max_examples: drawn examples in all (default 20, at least 2 per tower count), plus
            the stratified ones; ``seed`` None draws afresh each run.
        replay: also demand bitwise equality with the NumPy replay.

    Raises:
        ValueError: bad options only (named); a wrong algorithm never raises.
    """
    algorithm = get(fn)
    name = fn if isinstance(fn, str) else algorithm_name(fn)
    ops, dtypes = _options(max_towers, ops, dtypes)
    devices = list(local_devices() if devices is None else devices)
    if len(devices) < max_towers:
        raise ValueError(f"max_towers={max_towers} but only {len(devices)} devices: call "
                         f"towers.simulate_devices({max_towers}) first thing, or lower max_towers")
    dtypes = [d for d in dtypes if d.is_floating or any(o != "mean" for o in ops)]
    if not dtypes or not ops:
        raise ValueError(f"no op in {list(ops)} applies to the dtypes asked for")
    counts = sorted(set(tower_counts or range(1, max_towers + 1)))
    if counts[0] < 1 or counts[-1] > max_towers:
        raise ValueError(f"tower_counts must lie in 1..max_towers={max_towers}, got {counts}")
    per_count = max(2, -(-(max_examples or 20) // len(counts)))
    notes = (*unchecked(algorithm), *(() if replay else (
        "replay not checked (replay=True compares with the NumPy replay)",)))
    refused = replay_refusal(algorithm) if replay else None
    if refused:  # known without running anything: never a silent pass
        return CheckReport(name, False, 0, (refused,), None, notes)
    total, strata = 0, 0
    for n in counts:
        runs, failed = _search(algorithm, n, per_count, cases(n, dtypes, ops, shapes), devices,
                               replay, seed)  # fmt: skip
        total += runs
        if failed is None:
            explicit = stratified(n, dtypes, ops, seed or 0)
            strata += len(explicit)
            for case in explicit:
                failures = check_case(algorithm, case, devices, replay)
                if failures:
                    failed = _Failed(describe(case, devices) + "\n  (a stratified example, "
                                     "not shrunk)", failures)  # fmt: skip
                    break
        if failed is not None:
            return CheckReport(name, False, total, tuple(failed.failures), failed.example, notes,
                               strata)
    return CheckReport(name, True, total, notes=notes, stratified=strata)
