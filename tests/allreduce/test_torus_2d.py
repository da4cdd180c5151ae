"""The 2D-torus all-reduce as a schedule: proved for every n and grid, run on devices, formulas."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings

from tests.allreduce.machinery.test_primitives import Case
from tests.allreduce.test_bruck import assert_close_to_naive, assert_replays_bitwise
from tests.allreduce.test_halving_doubling import (
    cases,
    check_all_reduce,
    check_bytes,
    make_values,
    nbytes,
)
from tests.conftest import DEVICES, examples
from towers.allreduce import ALGORITHMS, ring, torus_2d
from towers.allreduce.machinery.primitives import record
from towers.allreduce.torus_2d import cost, grid, torus_2d_schedule
from towers.schedule import check_schedule, ring_schedule
from towers.schedule import cost as schedule_cost

bytes_sent, summation_depth = torus_2d.bytes_sent, torus_2d.summation_depth  # the schedule's


def _depth(n: int, rows: int | None = None) -> int:
    r, c = grid(n, rows)
    return (c - 1) + (r - 1)


def test_torus_2d_is_proved_for_every_n_up_to_64() -> None:
    report = check_schedule(torus_2d_schedule)
    assert report.ok, report
    assert report.depths == {n: _depth(n) for n in range(1, 65)}


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_every_grid_is_proved(rows: int) -> None:
    ns = [n for n in range(1, 65) if n % rows == 0]
    report = check_schedule(functools.partial(torus_2d_schedule, rows=rows), ns)
    assert report.ok, report
    assert report.depths == {n: _depth(n, rows) for n in ns}


@pytest.mark.long
def test_torus_2d_is_proved_for_sampled_large_n() -> None:
    report = check_schedule(torus_2d_schedule, [96, 100, 128, 144, 256])
    assert report.ok, report
    assert report.depths == {n: _depth(n) for n in report.ns}


def test_the_grid_is_as_square_as_n_allows() -> None:
    assert [grid(n) for n in (1, 4, 6, 8, 9, 12, 16, 1024)] == [
        (1, 1), (2, 2), (2, 3), (2, 4), (3, 3), (3, 4), (4, 4), (32, 32)]
    for n in range(1, 200):
        r, c = grid(n)
        assert r * c == n and r <= c
        assert all(n % d for d in range(r + 1, math.isqrt(n) + 1)), n  # no squarer factoring
    assert grid(8, rows=4) == (4, 2)


def test_a_prime_tower_count_degenerates_to_the_ring() -> None:
    """1×n: no column phase, and the row phases are ring_schedule's ticks exactly."""
    for n in (2, 3, 5, 7, 11, 13):
        assert grid(n) == (1, n)
        assert torus_2d_schedule(n).ticks == ring_schedule(n).ticks
    values = make_values(Case(5, (2, 7), tf.float32, "mean", 5))
    for got, want in zip(torus_2d()(values, op="mean"), ring()(values, op="mean"), strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_phases_stay_in_their_rows_and_columns() -> None:
    """Rows: C − 1 reduce ticks then C − 1 copy ticks within a row; columns: 2(R − 1) between."""
    for n, rows in [(8, None), (12, 3), (9, None), (16, 2)]:
        r, c = grid(n, rows)
        ticks = torus_2d_schedule(n, rows).ticks
        assert len(ticks) == 2 * (c - 1) + 2 * (r - 1)
        row_phase = ticks[: c - 1] + ticks[len(ticks) - (c - 1) :]
        column_phase = ticks[c - 1 : len(ticks) - (c - 1)]
        assert all(s.src // c == s.dst // c and s.dst % c == (s.src + 1) % c
                   for tick in row_phase for s in tick)
        assert all(s.src % c == s.dst % c and s.chunk // r == s.src % c
                   for tick in column_phase for s in tick)
        assert all(len(tick) == n * r for tick in row_phase)  # a part of R chunks per tower
        assert all(len(tick) == n for tick in column_phase)


@settings(max_examples=examples(ci=8))
@given(cases())
@example(Case(1, (), tf.float32, "sum", 0))
@example(Case(8, (0,), tf.float16, "mean", 1))
@example(Case(6, (13,), tf.bfloat16, "mean", 2))
@example(Case(4, (7,), tf.int64, "max", 3))
@example(Case(8, (2, 3, 7), tf.float32, "sum", 4))
def test_every_output_matches_the_reduction_and_naive(case: Case) -> None:
    values = make_values(case)
    with record() as rec:
        outputs = torus_2d()(values, op=case.op)
    check_all_reduce(outputs, values, case.op, summation_depth(case.n))
    assert_close_to_naive(outputs, values, case.op, summation_depth(case.n))
    check_bytes(rec, DEVICES[: case.n], bytes_sent(case.n, nbytes(case), case.dtype.size))
    assert rec.ticks() == torus_2d_schedule(case.n).num_ticks


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_a_fixed_grid_runs(rows: int) -> None:
    case = Case(8, (3, 5), tf.float32, "sum", rows)
    values = make_values(case)
    algorithm = torus_2d(rows=rows)
    with record() as rec:
        outputs = algorithm(values, op="sum")
    check_all_reduce(outputs, values, "sum", summation_depth(8, rows=rows))
    check_bytes(rec, DEVICES[:8], algorithm.bytes_sent(8, nbytes(case), 4))  # type: ignore[arg-type]
    assert rec.ticks() == torus_2d_schedule(8, rows).num_ticks


def test_formulas_come_from_the_schedule() -> None:
    assert bytes_sent(1, 40, 4) == [0]
    assert bytes_sent(6, 24, 4) == [40] * 6  # 2(n-1) chunks of 1 element
    assert bytes_sent(8, 32, 4, rows=4) == [56] * 8
    assert [summation_depth(n) for n in range(1, 10)] == [0, 1, 2, 2, 4, 3, 6, 4, 4]
    for n in range(1, 33):
        assert cost(n, 1024.0) == pytest.approx(schedule_cost(torus_2d_schedule(n), 1024.0)), n
    assert cost(12, 1024.0, rows=3) == pytest.approx(
        schedule_cost(torus_2d_schedule(12, 3), 1024.0))
    assert torus_2d(rows=2).params == {"rows": 2}
    assert ALGORITHMS["torus_2d"].schedule.splitlines()[0].split()[:3] == ["tick", "0", "│"]


def test_the_cost_model_predicts_it_to_1024_towers() -> None:
    """``costmodel`` reads the record: torus_2d is predicted wherever swing is, 8..1024 towers."""
    from towers.bench import costmodel

    assert {"torus_2d", "swing"} <= set(costmodel.formulas())
    link = costmodel.PRESETS["h100-nvlink"]
    for n in costmodel.DEFAULT_TOWERS:
        a, b, c = cost(n, 2.0**20)
        want = a * link.alpha + b * link.beta + c * link.gamma
        assert costmodel.predict("torus_2d", n, 2.0**20, link) == pytest.approx(want), n
    for n in (64, 100, 128):  # the closed form is the schedule's, beyond the tests above too
        assert cost(n, 2.0**20) == pytest.approx(schedule_cost(torus_2d_schedule(n), 2.0**20)), n


def test_towers_check_proves_it_then_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    from towers import cli

    code = cli.main(["check", "torus_2d", "--towers", "3", "--examples", "2", "--prove", "16",
                     "--max-towers", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0].startswith("PROVED: torus_2d for 16 tower counts (n=1..16) in ")
    assert "PASS: torus_2d (2 examples run)" in out


def test_replay_is_bitwise() -> None:
    assert_replays_bitwise(torus_2d(), [(4, "sum"), (6, "mean"), (8, "max")])


def test_bad_arguments_are_refused() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="rows must be an int >= 1"):
            torus_2d(rows=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        torus_2d_schedule(0)
    with pytest.raises(ValueError, match="rows=3 must divide the tower count n=8"):
        torus_2d(rows=3)(make_values(Case(8, (4,), tf.float32, "sum", 0)))
