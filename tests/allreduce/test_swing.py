"""Swing and the schedule interpreter: every output against the exact reduction.

Swing is a schedule (``swing_schedule``) run by ``run_schedule``; its bytes and depth
come from that same object, so these tests check the object three ways: the symbolic
proof for n = 1..64, the values on devices (eager and in a ``tf.function``), and the
bytes recorded at ``send`` against the counts derived from the schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given

from tests.allreduce.machinery.test_primitives import Case
from tests.allreduce.test_halving_doubling import (
    cases,
    check_all_reduce,
    check_bytes,
    make_values,
    nbytes,
)
from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS, run_schedule, swing
from towers.allreduce.machinery.primitives import record
from towers.allreduce.swing import cost, peer, swing_schedule
from towers.devices import canonical_device
from towers.schedule import Schedule, ScheduleError, Step, check_schedule, ring_schedule
from towers.schedule import cost as schedule_cost

bytes_sent, summation_depth = swing.bytes_sent, swing.summation_depth  # the schedule's


def test_swing_is_proved_for_every_n_up_to_64() -> None:
    report = check_schedule(swing_schedule)
    assert report.ok, report
    assert report.depths == {n: (n - 1).bit_length() for n in range(1, 65)}


def test_peers_follow_the_paper() -> None:
    """ρ(r, s) = r ± (1 − (−2)^(s+1))/3: distances 1, 1, 3, 5, 11 and even ranks go right."""
    assert [peer(0, s, 64) for s in range(5)] == [1, 63, 3, 59, 11]
    assert [peer(1, s, 64) for s in range(5)] == [0, 2, 62, 6, 54]
    for p in (2, 4, 8, 16, 32):
        for s in range(p.bit_length() - 1):
            assert all(peer(peer(r, s, p), s, p) == r for r in range(p))  # pairs, each step


@given(cases())
@example(Case(1, (), tf.float32, "sum", 0))
@example(Case(8, (0,), tf.float16, "mean", 1))
@example(Case(5, (13,), tf.bfloat16, "mean", 2))
@example(Case(6, (7,), tf.int64, "max", 3))
@example(Case(7, (2, 3, 7), tf.float32, "min", 4))
def test_every_output_matches_reduction(case: Case) -> None:
    values = make_values(case)
    with record() as rec:
        outputs = swing()(values, op=case.op)
    check_all_reduce(outputs, values, case.op, summation_depth(case.n))
    check_bytes(rec, DEVICES[: case.n], bytes_sent(case.n, nbytes(case), case.dtype.size))
    assert rec.ticks() == swing_schedule(case.n).num_ticks


@pytest.mark.parametrize("n", [3, 4, 8])
def test_inside_tf_function(n: int) -> None:
    case = Case(n, (3, 5), tf.float32, "mean", n)
    values = make_values(case)
    placed: list[str] = []

    @tf.function
    def run(*xs: tf.Tensor) -> list[tf.Tensor]:
        moved = []
        for x, device in zip(xs, DEVICES, strict=False):
            with tf.device(device):
                moved.append(tf.identity(x))
        outs = swing()(moved, op="mean")
        placed.extend(canonical_device(o.device) for o in outs)
        return outs

    outputs = run(*values)
    assert placed == DEVICES[:n]
    check_all_reduce(outputs, values, "mean", summation_depth(n), devices=[DEVICES[0]] * n)


def test_formulas_come_from_the_schedule() -> None:
    assert bytes_sent(1, 40, 4) == [0]
    assert bytes_sent(4, 32, 4) == [48] * 4  # 2(p-1) chunks of 2 elements
    # n = 6: p = 4, L = 5 padded to 8 (c = 2 elements): 6 chunks of 8 bytes, the fold 4 chunks.
    assert bytes_sent(6, 20, 4) == [80, 80, 48, 48, 32, 32]
    assert [summation_depth(n) for n in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    for n in range(1, 33):
        assert cost(n, 1024.0) == pytest.approx(schedule_cost(swing_schedule(n), 1024.0)), n
    assert ALGORITHMS["swing"].schedule.splitlines()[0].split()[:3] == ["tick", "0", "1"]


def test_replay_is_bitwise() -> None:
    replay = pytest.importorskip("towers.testing.replay").replay
    for n, op in [(3, "sum"), (6, "mean"), (8, "max")]:
        values = make_values(Case(n, (13,), tf.float32, op, n))
        expected = [o.numpy() for o in swing()(values, op=op)]
        got = replay(swing(), [v.numpy() for v in values], op, devices=DEVICES[:n])
        assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True)), (n, op)


def test_the_interpreter_refuses_what_the_checker_rejects() -> None:
    values = make_values(Case(3, (4,), tf.float32, "sum", 0))
    broken = Schedule("half", 3, 1, ((Step(0, 1, 0, "reduce"),),))
    with pytest.raises(ScheduleError, match="dropped chunk"):
        run_schedule(broken, values)
    with pytest.raises(ValueError, match="for 4 towers cannot all-reduce 3 values"):
        run_schedule(ring_schedule(4), values)
    gather = Schedule("gather", 3, 3, ring_schedule(3).ticks[2:], "all_gather")
    with pytest.raises(ValueError, match="all_gather schedule"):
        run_schedule(gather, values)
    with pytest.raises(ValueError, match="n must be an int"):
        swing_schedule(0)
