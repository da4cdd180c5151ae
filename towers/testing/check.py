"""Check any all-reduce against the contract with Hypothesis, and report what broke.

:func:`check_all_reduce` draws tower counts, shapes (``()``, ``(0,)``, primes, sizes
no tower count divides), dtypes and ops, runs the algorithm eagerly on logical
devices and checks every output (:mod:`towers.testing.properties`):

1. **Value.** Within ``γ_k·Σ|x_i|`` of the exact sum (:mod:`towers.testing.bounds`
   derives it), ``k`` the summation depth from the algorithm's registry record, or
   ``n − 1``, which holds for every summation tree. Integer sums, ``max`` and
   ``min`` must be exact.
2. **Placement.** Output i lives on input i's device.
3. **Agreement.** All outputs are bitwise identical (replicas must not drift).
4. **Replay** (``replay=True``): outputs bitwise equal to
   :func:`towers.testing.replay.replay` of the algorithm's graph. An algorithm that
   cannot be replayed (its record says so, or the replay refuses its graph) fails,
   with the reason.
5. **Bytes.** When the algorithm moved data with ``send``, the bytes each tower
   sent equal its record's ``bytes_sent(n, nbytes, itemsize)``.

Every (tower count, op) pair is run, whatever the budget: after its search, each tower
count gets one explicit, *stratified* example per op (``2n + 1`` elements, so no tower
count divides them; dense random values, float32 where it was asked for). A bug that
shows only for ``op="mean"`` at a non-power-of-two count is caught on every run, not
when the random draw happens to pair them. The report's ``examples`` counts the drawn
examples, its ``stratified`` the others.

A plain callable (no registry record) is checked too; the report's notes say which
properties could not be checked. A wrong algorithm never raises: the
:class:`CheckReport` says what failed, on the smallest example Hypothesis could
shrink to.

Example:
    >>> report = check_all_reduce(naive)          # doctest: +SKIP
    >>> assert report.ok, report
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from towers.allreduce.machinery.base import DTYPES, OPS, AllReduce
from towers.allreduce.machinery.registry import algorithm_name
from towers.allreduce.machinery.resolve import get
from towers.devices import local_devices
from towers.testing.bounds import unit_roundoff
from towers.testing.properties import Case, cases, check_case, describe, replay_refusal, unchecked
from towers.testing.values import (
    Closeness,
    assert_close,
    tower_shapes,
    tower_values,
    ulp_distance,
)

__all__ = [
    "DEFAULT_EXAMPLES",
    "CheckReport",
    "Closeness",
    "assert_close",
    "check_all_reduce",
    "stratified",
    "tower_shapes",
    "tower_values",
    "ulp_distance",
    "unit_roundoff",
]

DEFAULT_EXAMPLES = 20


@dataclasses.dataclass(frozen=True, repr=False)
class CheckReport:
    """What :func:`check_all_reduce` found. ``bool(report)`` is ``report.ok``.

    Its ``str`` (and ``repr``, so ``assert report.ok, report`` reads well) is the verdict.
    """

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
        head = f"{'PASS' if self.ok else 'FAIL'}: {self.algorithm} ({self.examples} examples run)"
        strata = (f"plus {self.stratified} stratified examples: every (tower count, op) pair, "
                  "and a scalar and an empty tensor at every tower count",
                  ) if self.stratified else ()
        lines = [head, *(f"  note: {note}" for note in (*self.notes, *strata))]
        if self.example is not None:
            lines += ["Smallest failing example:", self.example]
        if self.failures:
            lines += ["Failures:", *(f"  - {f}" for f in self.failures)]
        return "\n".join(lines)

    __repr__ = __str__


class _Failed(AssertionError):
    def __init__(self, example: str, failures: list[str]) -> None:
        super().__init__(example + "\n" + "\n".join(failures))
        self.example, self.failures = example, failures


def _devices(devices: Sequence[str] | None, max_towers: int) -> list[str]:
    if devices is None:
        devices = local_devices()
    if len(devices) < max_towers:
        raise ValueError(
            f"max_towers={max_towers} but only {len(devices)} devices: call "
            f"towers.simulate_devices({max_towers}) first thing, or lower max_towers"
        )
    return list(devices)


def _notes(fn: Any, replay: bool) -> tuple[str, ...]:
    notes = unchecked(fn)
    if not replay:
        notes.append("replay not checked (replay=True compares with the NumPy replay)")
    return tuple(notes)


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        report_multiple_bugs=False,
        print_blob=False,
        verbosity=Verbosity.quiet,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )


class _Options(NamedTuple):
    devices: list[str]
    replay: bool
    seed: int | None


def stratified(n: int, dtypes: Sequence[tf.DType], ops: Sequence[str], seed: int = 0
               ) -> list[Case]:
    """One example per op at ``n`` towers: ``2n + 1`` dense random elements per tower; and a
    scalar and an empty tensor (of the first float dtype, else the first dtype).

    float32 when asked for (else the first float dtype; integers for the ops that take
    them when no float is asked for); magnitudes in [1, 2^10), both signs, so no sum of
    8 towers overflows float16 and every value has mantissa bits that summation order shows.
    """
    rng = np.random.default_rng([seed, n])
    floats = sorted((d for d in dtypes if d.is_floating), key=lambda d: d != tf.float32)
    out = []
    for op in ops:
        dtype = floats[0] if floats else (None if op == "mean" else dtypes[0])
        if dtype is None:
            continue
        shape = (2 * n + 1,)
        if dtype.is_floating:
            draw: list[np.ndarray] = [
                rng.choice([-1.0, 1.0], shape) * rng.uniform(1, 2**10, shape) for _ in range(n)]
        else:
            draw = [rng.integers(-(2**10), 2**10, shape) for _ in range(n)]
        out.append(Case(n, [np.asarray(a).astype(dtype.as_numpy_dtype) for a in draw], op))
    edge = floats[0] if floats else dtypes[0]
    op = "sum" if "sum" in ops else ops[0]
    for edge_shape in ((), (0,)):  # a scalar and an empty tensor, whatever the draw gives
        out.append(Case(n, [np.full(edge_shape, t + 1, edge.as_numpy_dtype) for t in range(n)],
                        op))  # fmt: skip
    return out


def _search(
    algorithm: Any, n: int, examples: int, cases: st.SearchStrategy[Case], options: _Options
) -> tuple[int, _Failed | None]:
    """One Hypothesis search at ``n`` towers: (examples run, the shrunk failure or None)."""
    runs = [0]
    devices, replay, seed = options

    @_settings(examples)
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


def _strata(algorithm: Any, cases: Sequence[Case], options: _Options) -> _Failed | None:
    """The first stratified example that fails (run after the search, which shrinks what it
    finds: these catch what its draw missed), or None."""
    for case in cases:
        failures = check_case(algorithm, case, options.devices, options.replay)
        if failures:
            return _Failed(describe(case, options.devices) + "\n  (a stratified example, not "
                           "shrunk)", failures)
    return None


def check_all_reduce(
    fn: AllReduce | str,
    *,
    max_towers: int = 8,
    dtypes: Sequence[Any] = DTYPES,
    ops: Sequence[str] = OPS,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[tuple[int, ...]] | None = None,
    max_examples: int | None = None,
    devices: Sequence[str] | None = None,
    seed: int | None = 0,
    replay: bool = False,
    tower_counts: Sequence[int] | None = None,
) -> CheckReport:
    """Run Hypothesis over towers, shapes, dtypes and ops; report every broken promise.

    Every tower count from 1 to ``max_towers`` gets its own search, in ascending
    order, so each count is exercised and the first failure found has the fewest
    towers; Hypothesis then shrinks its shape, dtype, op and values.

    Args:
        fn: an all-reduce callable, or a registry name (``"naive"``).
        max_towers: the largest tower count.
        dtypes: dtypes to draw (default: every dtype the contract supports).
        ops: ops to draw (``"mean"`` is skipped for integer dtypes).
        shapes: shapes to draw (default :func:`tower_shapes`).
        max_examples: examples in all (default :data:`DEFAULT_EXAMPLES`, 20), spread
            over the tower counts, at least 2 each (the first is all zeros); the
            stratified examples (one per tower count and op, and a scalar and an empty
            tensor per tower count) come on top.
        devices: the devices to place towers on (default ``towers.local_devices()``).
        seed: Hypothesis seed, for reproducible runs; ``None`` draws afresh each run.
        replay: also demand bitwise equality with the NumPy replay (slower: one trace
            per example). An algorithm the replay cannot follow fails, with the reason.
        tower_counts: the counts to check (default ``1..max_towers``), e.g. ``[2, 4, 8]``
            for an algorithm that needs groups of two.

    Returns:
        A :class:`CheckReport`: ``ok``, the failures and the smallest failing example,
        printable as a verdict.

    Raises:
        ValueError: ``max_towers`` < 1, fewer devices than it, tower counts outside
            ``1..max_towers``, an op or dtype the contract does not have, or no op applies
            to any dtype.
            A wrong algorithm never raises; its report says what failed.

    Example:
        >>> report = check_all_reduce("naive", max_towers=4)   # doctest: +SKIP
        >>> print(report)                                      # doctest: +SKIP
        PASS: naive (20 examples run)
    """
    algorithm = get(fn)
    name = fn if isinstance(fn, str) else algorithm_name(fn)
    if isinstance(max_towers, bool) or not isinstance(max_towers, int) or max_towers < 1:
        raise ValueError(f"max_towers must be an integer >= 1, got {max_towers!r}")
    # the caller's options are checked here: a bad one must not read as the algorithm's failure
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
    options = _Options(_devices(devices, max_towers), replay, seed)
    dtypes = [d for d in dtypes if d.is_floating or any(o != "mean" for o in ops)]
    if not dtypes or not ops:
        raise ValueError(f"no op in {list(ops)} applies to the dtypes asked for")
    counts = sorted(set(tower_counts or range(1, max_towers + 1)))
    if counts[0] < 1 or counts[-1] > max_towers:
        raise ValueError(f"tower_counts must lie in 1..max_towers={max_towers}, got {counts}")
    per_count = max(2, -(-(max_examples or DEFAULT_EXAMPLES) // len(counts)))
    notes, total, strata = _notes(algorithm, replay), 0, 0
    refused = replay_refusal(algorithm) if replay else None
    if refused:  # known without running anything: never a silent pass
        return CheckReport(name, False, 0, (refused,), None, notes)
    for n in counts:
        runs, failed = _search(algorithm, n, per_count, cases(n, dtypes, ops, shapes), options)
        total += runs
        if failed is None:
            explicit = stratified(n, dtypes, ops, seed or 0)
            strata += len(explicit)
            failed = _strata(algorithm, explicit, options)
        if failed is not None:
            return CheckReport(name, False, total, tuple(failed.failures), failed.example, notes,
                               strata)
    return CheckReport(name, True, total, notes=notes, stratified=strata)
