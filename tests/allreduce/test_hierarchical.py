"""Hierarchical all-reduce: every output, every (inner, outer, group_size) shape of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given
from hypothesis import strategies as st

from tests.allreduce.test_halving_doubling import (
    Case,
    cases,
    check_all_reduce,
    check_bytes,
    make_values,
    nbytes,
)
from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS, naive, parameter_device
from towers.allreduce.halving_doubling import halving_doubling
from towers.allreduce.hierarchical import bytes_sent, hierarchical, summation_depth
from towers.allreduce.machinery.base import AllReduce
from towers.allreduce.machinery.primitives import Recorder, Transfer, record
from towers.devices import canonical_device

PARTS: dict[str, AllReduce | str] = {
    "naive": naive,
    "parameter_device": parameter_device(),
    "halving_doubling": halving_doubling(),
    "name:naive": "naive",
}


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Case, int, str, str]:
    """A case, a group size (dividing its tower count or not, up to n + 1), inner/outer parts."""
    case = draw(cases())
    group_size = draw(st.integers(1, case.n + 1))
    return case, group_size, draw(st.sampled_from(list(PARTS))), draw(st.sampled_from(list(PARTS)))


@given(layouts())
@example((Case(1, (), tf.float32, "sum", 0), 1, "naive", "naive"))
@example((Case(8, (13,), tf.float16, "mean", 1), 4, "halving_doubling", "halving_doubling"))
@example((Case(6, (0,), tf.bfloat16, "mean", 2), 2, "parameter_device", "halving_doubling"))
@example((Case(6, (2, 3, 7), tf.int32, "min", 3), 3, "halving_doubling", "name:naive"))
@example((Case(7, (5,), tf.float32, "mean", 4), 2, "naive", "halving_doubling"))
@example((Case(8, (3,), tf.float64, "sum", 5), 3, "halving_doubling", "parameter_device"))
def test_every_output_matches_reduction(layout: tuple[Case, int, str, str]) -> None:
    case, k, inner, outer = layout
    params: dict[str, Any] = {"inner": PARTS[inner], "outer": PARTS[outer], "group_size": k}
    values = make_values(case)
    with record() as rec:
        outputs = hierarchical(**params)(values, op=case.op)
    check_all_reduce(outputs, values, case.op, summation_depth(case.n, **params))
    expected = bytes_sent(case.n, nbytes(case), case.dtype.size, **params)
    check_bytes(rec, DEVICES[: case.n], expected)


def test_formulas_compose_from_parts() -> None:
    hd = halving_doubling()
    # n = 8, k = 2: naive inside (leader and member each send S = 40), halving-doubling
    # over 4 leaders (L = 10 padded to 12: 2·3·3·4 = 72), then S from leader to member.
    assert bytes_sent(8, 40, 4, inner="naive", outer=hd, group_size=2) == [152, 40] * 4
    assert summation_depth(8, inner="naive", outer=hd, group_size=2) == 1 + 2
    assert summation_depth(8, inner="naive", outer="naive", group_size=8) == 7
    nested: Any = hierarchical(inner=hierarchical("naive", "naive", 2), outer=hd, group_size=4)
    assert nested.summation_depth(8) == (1 + 1) + 1
    # inner on 4 towers: [12, 4, 12, 4]; hd on 2 leaders: 8 each; leader copies 3·4.
    assert nested.bytes_sent(8, 4, 4) == [32, 4, 12, 4] * 2


def test_nested_hierarchical_runs() -> None:
    case = Case(8, (7,), tf.float32, "mean", 5)
    inner = hierarchical("naive", "naive", 2)
    algo: Any = hierarchical(inner=inner, outer=halving_doubling(), group_size=4)
    values = make_values(case)
    with record() as rec:
        outputs = algo(values, op="mean")
    check_all_reduce(outputs, values, "mean", algo.summation_depth(8))
    check_bytes(rec, DEVICES[:8], algo.bytes_sent(8, nbytes(case), 4))


def test_inside_tf_function() -> None:
    case = Case(6, (5,), tf.float64, "sum", 7)
    values = make_values(case)
    algo: Any = hierarchical("parameter_device", halving_doubling(), group_size=3)

    @tf.function
    def run(*xs: tf.Tensor) -> list[tf.Tensor]:
        moved = []
        for x, device in zip(xs, DEVICES, strict=False):
            with tf.device(device):
                moved.append(tf.identity(x))
        outs = algo(moved)
        assert [canonical_device(o.device) for o in outs] == DEVICES[:6]
        return outs

    outputs = run(*values)
    check_all_reduce(outputs, values, "sum", algo.summation_depth(6), devices=[DEVICES[0]] * 6)


def test_default_outer_is_ring() -> None:
    if "ring" not in ALGORITHMS:
        pytest.skip("'ring' is not registered in towers.allreduce yet; the default needs it")
    case = Case(4, (9,), tf.float32, "sum", 8)
    values = make_values(case)
    algo: Any = hierarchical()
    with record() as rec:
        outputs = algo(values)
    check_all_reduce(outputs, values, "sum", algo.summation_depth(4))
    check_bytes(rec, DEVICES[:4], algo.bytes_sent(4, nbytes(case), 4))


def test_uneven_groups_keep_the_remainder_in_the_last_group() -> None:
    from towers.allreduce.hierarchical import group_sizes

    assert group_sizes(7, 2) == [2, 2, 2, 1] and group_sizes(8, 3) == [3, 3, 2]
    assert group_sizes(1, 2) == [1] and group_sizes(3, 5) == [3]
    # n = 5, k = 2, naive inside and out (S = 8): group {4} has no inner traffic and no
    # member; the outer naive on 3 leaders: tower 0 sends 2S, towers 2 and 4 send S.
    assert bytes_sent(5, 8, 4, inner="naive", outer="naive", group_size=2) == [
        8 + 16 + 8, 8, 8 + 8 + 8, 8, 0 + 8 + 0]
    assert summation_depth(5, inner="naive", outer="naive", group_size=2) == 1 + 2
    assert summation_depth(5, inner="naive", outer="naive", group_size=4) == 3 + 1


@pytest.mark.parametrize("n", [1, 3, 5, 7])
def test_defaults_work_for_odd_tower_counts(n: int) -> None:
    case = Case(n, (5,), tf.float32, "sum", n)
    values = make_values(case)
    algo: Any = ALGORITHMS["hierarchical"]()
    with record() as rec:
        outputs = algo(values)
    check_all_reduce(outputs, values, "sum", algo.summation_depth(n))
    check_bytes(rec, DEVICES[:n], algo.bytes_sent(n, nbytes(case), 4))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        hierarchical(group_size=0)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 1, got 2\.0"):
        hierarchical(group_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="inner must be a registry name"):
        hierarchical(inner=5)  # type: ignore[arg-type]
    values = make_values(Case(2, (3,), tf.float32, "sum", 0))
    with pytest.raises(ValueError, match="unknown all_reduce 'nope'"):
        hierarchical(inner="nope", outer="naive")(values)


def test_replay_is_bitwise() -> None:
    replay = pytest.importorskip("towers.testing.replay").replay
    algo = hierarchical(halving_doubling(), "naive", group_size=3)
    case = Case(6, (4, 3), tf.float32, "mean", 9)
    values = make_values(case)
    expected = [o.numpy() for o in algo(values, op="mean")]
    got = replay(algo, [v.numpy() for v in values], "mean", devices=DEVICES[:6])
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


def _ticks(rec: Recorder, keep: Callable[[Transfer], bool]) -> list[int]:
    """The distinct ticks of the recorded transfers that ``keep`` picks, sorted."""
    return sorted({t.tick for t in rec.transfers if keep(t) and t.tick is not None})


def test_phases_tick_one_after_another() -> None:
    # n = 8, k = 2: naive in the groups (ticks 0, 1), halving-doubling over the 4 leaders
    # shifted after it, then the copies to the members.
    case = Case(8, (10,), tf.float32, "sum", 9)
    values = make_values(case)
    hd = halving_doubling()
    with record() as rec:
        outputs = hierarchical("naive", hd, group_size=2)(values)
    leaders = [naive(values[g : g + 2])[0] for g in range(0, 8, 2)]
    with record() as alone:
        expected = hd(leaders)
    hd_ticks = _ticks(alone, lambda t: True)
    inner = _ticks(rec, lambda t: t.note in ("gather", "broadcast"))
    outer = _ticks(rec, lambda t: DEVICES.index(t.src) // 2 != DEVICES.index(t.dst) // 2)
    final = _ticks(rec, lambda t: t.note == "group-broadcast")
    assert inner == [0, 1]
    assert outer == [2 + t for t in hd_ticks]
    assert final == [outer[-1] + 1]
    # Only labels moved: outputs bitwise those of the parts composed by hand, bytes as before.
    for i, out in enumerate(outputs):
        assert out.numpy().tobytes() == expected[i // 2].numpy().tobytes()
    check_bytes(rec, DEVICES[:8], bytes_sent(8, nbytes(case), 4, inner="naive", outer=hd))


def test_nested_phases_tick_one_after_another() -> None:
    # inner: hierarchical(naive, naive, 2) on 4 towers takes ticks 0-1, 2-3, 4; then
    # halving-doubling between towers 0 and 4 from tick 5 (b ticks); then 0 and 4 copy to
    # their 3 members each, at tick 5 + b. The enclosing offset is not added twice.
    case = Case(8, (6,), tf.float32, "mean", 10)
    values = make_values(case)
    hd = halving_doubling()
    with record() as alone:
        hd(values[0:8:4])
    b = len(_ticks(alone, lambda t: True))
    algo: Any = hierarchical(hierarchical("naive", "naive", 2), hd, group_size=4)
    with record() as rec:
        outputs = algo(values, op="mean")
    ticks = [t.tick for t in rec.transfers]
    cross = _ticks(rec, lambda t: DEVICES.index(t.src) // 4 != DEVICES.index(t.dst) // 4)
    assert _ticks(rec, lambda t: True) == list(range(5 + b + 1))
    assert cross == list(range(5, 5 + b))
    assert ticks[-6:] == [5 + b] * 6 and ticks.count(5 + b) == 6
    check_all_reduce(outputs, values, "mean", algo.summation_depth(8))
    check_bytes(rec, DEVICES[:8], algo.bytes_sent(8, nbytes(case), 4))
