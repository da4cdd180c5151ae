"""PAT as a schedule: proved for every n and aggregation, run on devices, held to its formulas."""

from __future__ import annotations

import functools

import pytest
import tensorflow as tf
from hypothesis import example, given, settings
from hypothesis import strategies as st

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
from towers.allreduce import ALGORITHMS, pat
from towers.allreduce.bruck import bruck_schedule
from towers.allreduce.machinery.primitives import record
from towers.allreduce.pat import chunks_per_dimension, cost, pat_schedule
from towers.schedule import check_schedule
from towers.schedule import cost as schedule_cost

bytes_sent, summation_depth = pat.bytes_sent, pat.summation_depth  # the schedule's


@pytest.mark.parametrize("aggregation", [None, 1, 2, 3])
def test_pat_is_proved_for_every_n_up_to_64(aggregation: int | None) -> None:
    report = check_schedule(functools.partial(pat_schedule, aggregation=aggregation))
    assert report.ok, report
    assert report.depths == {n: (n - 1).bit_length() for n in range(1, 65)}


@pytest.mark.long
def test_pat_is_proved_for_sampled_large_n() -> None:
    report = check_schedule(pat_schedule, [65, 96, 127, 128, 129, 200, 255, 256])
    assert report.ok, report
    assert report.depths == {n: (n - 1).bit_length() for n in report.ns}


def _gather(n: int, aggregation: int | None = None) -> tuple[tuple, ...]:
    schedule = pat_schedule(n, aggregation)
    return schedule.ticks[schedule.num_ticks // 2 :]


def test_far_hops_carry_little_and_near_hops_much() -> None:
    """The all-gather runs Bruck's dimensions reversed: distance 2^(K−1) first with one
    chunk, distance 1 last with ~n/2; Bruck sends its n/2 chunks 2^(K−1) away, last."""
    for n in range(2, 40):
        k_steps = (n - 1).bit_length()
        gather = _gather(n)
        assert len(gather) == k_steps
        for tick, k in zip(gather, reversed(range(k_steps)), strict=True):
            assert {(s.src - s.dst) % n for s in tick} == {(1 << k) % n}, (n, k)
            per_tower = len(tick) // n
            assert per_tower == chunks_per_dimension(n)[k]
            assert all(sum(s.src == r for s in tick) == per_tower for r in range(n))
        assert len(gather[0]) == n  # one chunk per tower crosses the longest distance
        bruck_last = bruck_schedule(n).ticks[-1]
        assert len(gather[-1]) // n == n // 2  # the odd offsets, one hop away
        assert len(bruck_last) // n == n - (1 << (k_steps - 1))


def test_chunks_per_dimension_counts_the_lowest_set_bits() -> None:
    for n in range(1, 70):
        want = [sum(1 for j in range(1, n) if (j & -j) == 1 << k)
                for k in range((n - 1).bit_length())]
        assert chunks_per_dimension(n) == want
        assert sum(want) == n - 1


@pytest.mark.parametrize("aggregation", [1, 2, 3])
def test_aggregation_bounds_chunks_per_tick(aggregation: int) -> None:
    for n in range(1, 20):
        schedule = pat_schedule(n, aggregation)
        for tick in schedule.ticks:
            assert all(sum(s.src == r for s in tick) <= aggregation for r in range(n))
        want = 2 * sum(-(-m // aggregation) for m in chunks_per_dimension(n))
        assert schedule.num_ticks == want
    assert pat_schedule(8, 1).num_ticks == 2 * 7  # one chunk per peer per tick: n − 1 each phase


@settings(max_examples=examples(ci=8))
@given(cases(), st.sampled_from([None, 1, 2]))
@example(Case(1, (), tf.float32, "sum", 0), None)
@example(Case(8, (0,), tf.float16, "mean", 1), None)
@example(Case(5, (13,), tf.bfloat16, "mean", 2), 1)
@example(Case(6, (7,), tf.int64, "max", 3), 2)
@example(Case(7, (2, 3, 7), tf.float32, "sum", 4), None)
def test_every_output_matches_the_reduction_and_naive(case: Case,
                                                      aggregation: int | None) -> None:
    values = make_values(case)
    algorithm = pat(aggregation=aggregation)
    depth = summation_depth(case.n, aggregation=aggregation)
    with record() as rec:
        outputs = algorithm(values, op=case.op)
    check_all_reduce(outputs, values, case.op, depth)
    assert_close_to_naive(outputs, values, case.op, depth)
    expected = algorithm.bytes_sent(case.n, nbytes(case), case.dtype.size)
    assert expected == bytes_sent(case.n, nbytes(case), case.dtype.size, aggregation=aggregation)
    check_bytes(rec, DEVICES[: case.n], expected)  # type: ignore[arg-type]
    assert rec.ticks() == pat_schedule(case.n, aggregation).num_ticks


def test_formulas_come_from_the_schedule() -> None:
    assert bytes_sent(1, 40, 4) == [0]
    assert bytes_sent(5, 20, 4) == bytes_sent(5, 20, 4, aggregation=1) == [32] * 5
    assert [summation_depth(n) for n in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    for aggregation in (None, 1, 2, 3):
        for n in range(1, 33):
            want = schedule_cost(pat_schedule(n, aggregation), 1024.0)
            assert cost(n, 1024.0, aggregation) == pytest.approx(want), (n, aggregation)
    assert pat(aggregation=2).params == {"aggregation": 2}
    assert ALGORITHMS["pat"].schedule.splitlines()[0].split()[:3] == ["tick", "0", "1"]


def test_the_cost_model_predicts_it_to_1024_towers() -> None:
    """``costmodel`` reads the record: pat is predicted wherever swing is, 8..1024 towers."""
    from towers.bench import costmodel

    assert {"pat", "swing"} <= set(costmodel.formulas())
    link = costmodel.PRESETS["h100-nvlink"]
    for n in costmodel.DEFAULT_TOWERS:
        a, b, c = cost(n, 2.0**20)
        want = a * link.alpha + b * link.beta + c * link.gamma
        assert costmodel.predict("pat", n, 2.0**20, link) == pytest.approx(want), n
    for n in (64, 100, 128):  # the closed form is the schedule's, beyond the tests above too
        assert cost(n, 2.0**20) == pytest.approx(schedule_cost(pat_schedule(n), 2.0**20)), n


def test_towers_check_proves_it_then_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    from towers import cli

    code = cli.main(["check", "pat", "--towers", "3", "--examples", "2", "--prove", "16",
                     "--max-towers", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0].startswith("PROVED: pat for 16 tower counts (n=1..16) in ")
    assert "PASS: pat (2 examples run)" in out


def test_replay_is_bitwise() -> None:
    assert_replays_bitwise(pat(), [(3, "sum"), (6, "mean"), (8, "max")])
    assert_replays_bitwise(pat(aggregation=1), [(5, "sum")])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        pat_schedule(0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="aggregation must be an int >= 1"):
            pat(aggregation=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aggregation must be an int >= 1"):
        cost(4, 8.0, aggregation=0)
