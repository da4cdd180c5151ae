"""Bruck as a schedule: proved for every n, run on devices, held to naive and to its formulas.

The helpers at the top (``assert_close_to_naive``, ``assert_replays_bitwise``) are shared
with ``test_pat`` and ``test_torus_2d``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings

from tests.allreduce.machinery.test_primitives import Case
from tests.allreduce.test_halving_doubling import (
    cases,
    check_all_reduce,
    check_bytes,
    make_values,
    nbytes,
)
from tests.conftest import DEVICES, examples
from towers.allreduce import ALGORITHMS, bruck, naive
from towers.allreduce.bruck import bruck_schedule, cost
from towers.allreduce.machinery.primitives import record
from towers.schedule import check_schedule
from towers.schedule import cost as schedule_cost
from towers.testing.bounds import sum_bound

# ---- shared with test_pat and test_torus_2d ---------------------------------------------------

bytes_sent, summation_depth = bruck.bytes_sent, bruck.summation_depth  # the schedule's


def assert_close_to_naive(outputs: Sequence[tf.Tensor], values: Sequence[tf.Tensor], op: str,
                          depth: int) -> None:
    """Every output against naive's output on the same tower: both sums are within their own
    bound of the exact one (``sum_bound``, depth ``depth`` and naive's ``n − 1``), so they
    differ by at most the two bounds added (the triangle inequality); max, min and
    integer sums are exact, so there they must agree bit for bit."""
    arrays = [v.numpy() for v in values]
    _, ours = sum_bound(arrays, op, depth)
    _, theirs = sum_bound(arrays, op, ALGORITHMS["naive"]().summation_depth(len(values)) or 0)
    for i, (got, want) in enumerate(zip(outputs, naive(list(values), op=op), strict=True)):
        diff = np.abs(got.numpy().astype(np.float64) - want.numpy().astype(np.float64))
        worst = float(np.max(diff - (ours + theirs), initial=-1.0))
        assert worst <= 0.0, f"output {i} is {worst} beyond the bound from naive's"


def assert_replays_bitwise(algorithm: Callable[..., list[tf.Tensor]],
                           runs: Sequence[tuple[int, str]]) -> None:
    """The NumPy replay of the traced graph gives the device outputs bit for bit."""
    replay = pytest.importorskip("towers.testing.replay").replay
    for n, op in runs:
        values = make_values(Case(n, (13,), tf.float32, op, n))
        expected = [o.numpy() for o in algorithm(values, op=op)]
        got = replay(algorithm, [v.numpy() for v in values], op, devices=DEVICES[:n])
        assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True)), (n, op)


# ---- bruck ------------------------------------------------------------------------------------


def test_bruck_is_proved_for_every_n_up_to_64() -> None:
    report = check_schedule(bruck_schedule)
    assert report.ok, report
    assert report.depths == {n: (n - 1).bit_length() for n in range(1, 65)}


@pytest.mark.long
def test_bruck_is_proved_for_sampled_large_n() -> None:
    """Non-powers of two around the powers, up to 256 (a few seconds; 1024 takes ~a minute)."""
    start = time.perf_counter()
    report = check_schedule(bruck_schedule, [65, 96, 127, 128, 129, 200, 255, 256])
    assert report.ok, report
    assert report.depths == {n: (n - 1).bit_length() for n in report.ns}
    assert time.perf_counter() - start < 60


def test_all_gather_is_brucks_concatenation() -> None:
    """Step k: tower r copies chunks r + i, i < min(2^k, n − 2^k), to tower r − 2^k."""
    for n in range(1, 40):
        k_steps = (n - 1).bit_length()
        gather = bruck_schedule(n).ticks[k_steps:]
        assert len(gather) == k_steps
        for k, tick in enumerate(gather):
            d = 1 << k
            want = {(r, (r - d) % n, (r + i) % n) for r in range(n) for i in range(min(d, n - d))}
            assert {(s.src, s.dst, s.chunk) for s in tick} == want, (n, k)
            assert {s.kind for s in tick} == {"copy"}


@settings(max_examples=examples(ci=8))
@given(cases())
@example(Case(1, (), tf.float32, "sum", 0))
@example(Case(8, (0,), tf.float16, "mean", 1))
@example(Case(5, (13,), tf.bfloat16, "mean", 2))
@example(Case(6, (7,), tf.int64, "max", 3))
@example(Case(7, (2, 3, 7), tf.float32, "sum", 4))
def test_every_output_matches_the_reduction_and_naive(case: Case) -> None:
    values = make_values(case)
    with record() as rec:
        outputs = bruck()(values, op=case.op)
    check_all_reduce(outputs, values, case.op, summation_depth(case.n))
    assert_close_to_naive(outputs, values, case.op, summation_depth(case.n))
    check_bytes(rec, DEVICES[: case.n], bytes_sent(case.n, nbytes(case), case.dtype.size))
    assert rec.ticks() == bruck_schedule(case.n).num_ticks


def test_formulas_come_from_the_schedule() -> None:
    assert bytes_sent(1, 40, 4) == [0]
    assert bytes_sent(5, 20, 4) == [32] * 5  # 2(n-1) chunks of 1 element
    assert bytes_sent(6, 28, 4) == [80] * 6  # L = 7 padded to 12: 10 chunks of 2 elements
    assert [summation_depth(n) for n in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    for n in range(1, 33):
        assert cost(n, 1024.0) == pytest.approx(schedule_cost(bruck_schedule(n), 1024.0)), n
    assert ALGORITHMS["bruck"].schedule.splitlines()[0].split()[:3] == ["tick", "0", "1"]


def test_the_cost_model_predicts_it_to_1024_towers() -> None:
    """``costmodel`` reads the record: bruck is predicted wherever swing is, 8..1024 towers."""
    from towers.bench import costmodel

    assert {"bruck", "swing"} <= set(costmodel.formulas())
    link = costmodel.PRESETS["h100-nvlink"]
    for n in costmodel.DEFAULT_TOWERS:
        a, b, c = cost(n, 2.0**20)
        want = a * link.alpha + b * link.beta + c * link.gamma
        assert costmodel.predict("bruck", n, 2.0**20, link) == pytest.approx(want), n
    for n in (64, 100, 128):  # the closed form is the schedule's, beyond the tests above too
        assert cost(n, 2.0**20) == pytest.approx(schedule_cost(bruck_schedule(n), 2.0**20)), n


def test_towers_check_proves_it_then_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    from towers import cli

    code = cli.main(["check", "bruck", "--towers", "3", "--examples", "2", "--prove", "16",
                     "--max-towers", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0].startswith("PROVED: bruck for 16 tower counts (n=1..16) in ")
    assert "PASS: bruck (2 examples run)" in out


def test_replay_is_bitwise() -> None:
    assert_replays_bitwise(bruck(), [(3, "sum"), (6, "mean"), (8, "max")])


def test_bad_tower_counts_are_refused() -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            bruck_schedule(bad)  # type: ignore[arg-type]
