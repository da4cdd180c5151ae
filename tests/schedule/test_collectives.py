"""Reduce-scatter, all-gather and broadcast schedules: proved for n = 1..64, numbers, bad input."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from towers.allreduce.collectives import (
    COLLECTIVE_ALGORITHMS,
    collective_algorithm,
    format_collective,
)
from towers.schedule import (
    Schedule,
    Step,
    binomial_broadcast,
    chain_broadcast,
    check_schedule,
    doubling_all_gather,
    even_sizes,
    flat_broadcast,
    format_schedule,
    halving_reduce_scatter,
    ring_all_gather,
    ring_reduce_scatter,
    ring_schedule,
    rooted,
    summation_depth,
)
from towers.schedule.collectives import fold, schedule_bytes

GENERATORS = {
    "ring_reduce_scatter": ring_reduce_scatter,
    "halving_reduce_scatter": halving_reduce_scatter,
    "ring_all_gather": ring_all_gather,
    "doubling_all_gather": doubling_all_gather,
    "binomial_broadcast": binomial_broadcast,
    "flat_broadcast": flat_broadcast,
    "chain_broadcast": chain_broadcast,
    "chain_broadcast_1_chunk": functools.partial(chain_broadcast, chunks=1),
    "chain_broadcast_9_chunks": functools.partial(chain_broadcast, chunks=9),
    "tree_rooted_last": lambda n: rooted(binomial_broadcast(n), n - 1),
    "chain_rooted_middle": lambda n: rooted(chain_broadcast(n, 3), n // 2),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_schedule_is_proved_for_1_to_64_towers(name: str) -> None:
    report = check_schedule(GENERATORS[name], range(1, 65))
    assert report.ok, str(report)
    assert report.ns == tuple(range(1, 65))


@pytest.mark.parametrize("key", sorted(COLLECTIVE_ALGORITHMS), ids="/".join)
def test_registry_closed_forms_match_the_schedules(key: tuple[str, str]) -> None:
    record = COLLECTIVE_ALGORITHMS[key]
    assert record.kind == key[0] and record.name == key[1]
    for n in range(1, 65):
        s = record.generator(n)
        assert (s.towers, s.collective) == (n, key[0])
        assert s.num_ticks == TICKS[key](n), n
        assert summation_depth(s) == record.summation_depth(n), n
        assert record.cost(n, 1000.0)[0] == s.num_ticks  # no empty ticks


def _folded_ticks(n: int) -> int:
    m, r = fold(n)
    return m.bit_length() - 1 + 2 * (r > 0)


# The tick counts in closed form (the registry's summaries).
TICKS = {
    ("reduce_scatter", "ring"): lambda n: n - 1,
    ("reduce_scatter", "halving"): _folded_ticks,
    ("all_gather", "ring"): lambda n: n - 1,
    ("all_gather", "doubling"): _folded_ticks,
    ("broadcast", "flat"): lambda n: int(n > 1),
    ("broadcast", "tree"): lambda n: (n - 1).bit_length(),
    ("broadcast", "chain"): lambda n: 4 + n - 2 if n > 1 else 0,
}


# The summation depths in closed form (the collectives docstring's table).
DEPTHS = {
    ("reduce_scatter", "ring"): lambda n: n - 1,
    ("reduce_scatter", "halving"): lambda n: fold(n)[0].bit_length() - 1 + (fold(n)[1] > 0),
    ("all_gather", "ring"): lambda n: 0,
    ("all_gather", "doubling"): lambda n: 0,
    ("broadcast", "flat"): lambda n: 0,
    ("broadcast", "tree"): lambda n: 0,
    ("broadcast", "chain"): lambda n: 0,
}


@pytest.mark.parametrize("key", sorted(COLLECTIVE_ALGORITHMS), ids="/".join)
def test_derived_depth_and_cost_equal_the_closed_forms(key: tuple[str, str]) -> None:
    record = COLLECTIVE_ALGORITHMS[key]
    for n in range(1, 17):
        assert record.summation_depth(n) == DEPTHS[key](n), n
        a, _, c = record.cost(n, 1000.0)
        assert a == TICKS[key](n)
        assert (c == 0) == (key[0] != "reduce_scatter" or n == 1)  # only reducing costs γ


def test_ring_halves_are_the_ring_all_reduce() -> None:
    for n in range(1, 17):
        ring = ring_schedule(n)
        assert ring_reduce_scatter(n).ticks + ring_all_gather(n).ticks == ring.ticks
        assert ring_reduce_scatter(n).owners == ring_all_gather(n).owners == tuple(range(n))


@pytest.mark.parametrize("n", range(1, 17))
def test_bytes_follow_the_sharding_rule_exactly(n: int) -> None:
    for length in (0, 1, n - 1, n, 3 * n + 2, 101):
        sizes = even_sizes(length, n)
        total = 4 * length
        ring_rs = COLLECTIVE_ALGORITHMS[("reduce_scatter", "ring")].bytes_sent(n, total, 4)
        ring_ag = COLLECTIVE_ALGORITHMS[("all_gather", "ring")].bytes_sent(n, total, 4)
        # ring reduce-scatter: tower p sends every chunk but its own; all-gather: all but p+1's
        assert ring_rs == [4 * (length - sizes[p]) for p in range(n)]
        assert ring_ag == [4 * (length - sizes[(p + 1) % n]) for p in range(n)]
        halving = COLLECTIVE_ALGORITHMS[("reduce_scatter", "halving")].bytes_sent(n, total, 4)
        if fold(n)[1] == 0:  # a power of two: each tower sends n-1 chunks, all but its own
            assert halving == ring_rs
        tree = COLLECTIVE_ALGORITHMS[("broadcast", "tree")].bytes_sent(n, total, 4)
        assert sum(tree) == 4 * length * (n - 1)  # every other tower receives it once
        chain = COLLECTIVE_ALGORITHMS[("broadcast", "chain")].bytes_sent(n, total, 4)
        assert chain == [4 * length] * (n - 1) + [0]
        flat = COLLECTIVE_ALGORITHMS[("broadcast", "flat")].bytes_sent(n, total, 4)
        assert flat == [4 * length * (n - 1)] + [0] * (n - 1)  # the root sends every copy


@settings(max_examples=examples(ci=20))
@given(length=st.integers(0, 500), pieces=st.integers(1, 70))
def test_even_sizes_is_numpy_array_split(length: int, pieces: int) -> None:
    sizes = even_sizes(length, pieces)
    assert sizes == [len(part) for part in np.array_split(np.arange(length), pieces)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == length


def test_non_powers_of_two_fold_the_extra_towers_in_and_out() -> None:
    assert [fold(n) for n in (1, 2, 3, 6, 8, 12)] == [(1, 0), (2, 0), (2, 1), (4, 2), (8, 0),
                                                        (8, 4)]
    s = halving_reduce_scatter(6)  # towers 4, 5 fold into 0, 1; 0, 1 hand chunks 4, 5 back
    assert s.ticks[0] == tuple(Step(4 + i, i, c, "reduce") for i in range(2) for c in range(6))
    assert s.ticks[-1] == (Step(0, 4, 4, "copy"), Step(1, 5, 5, "copy"))
    g = doubling_all_gather(6)
    assert g.ticks[0] == (Step(4, 0, 4, "copy"), Step(5, 1, 5, "copy"))
    assert {step.dst for step in g.ticks[-1]} == {4, 5}


def test_drawn_schedules_match_the_module_docstring() -> None:
    rows = format_schedule(halving_reduce_scatter(4)).splitlines()
    assert rows[1].split() == ["tower", "0", "c2c3+▶2", "c1+▶1"]
    rows = format_schedule(chain_broadcast(5, 3)).splitlines()
    assert rows[2].split() == ["tower", "1", "c0", "▶2", "c1", "▶2", "c2", "▶2"]
    text = format_collective("broadcast", "tree", 5, nbytes=40)
    assert "3 ticks" in text and "bytes sent per tower for 40 bytes: [120, 40, 0, 0, 0]" in text


def test_broadcast_semantics_in_the_ir() -> None:
    s = Schedule("b", 3, 2, (), "broadcast")
    assert s.owners == (0, 0)
    with pytest.raises(ValueError, match="one root"):
        Schedule("b", 3, 2, (), "broadcast", owners=(0, 1))
    assert not check_schedule(lambda n: Schedule("b", n, 1, (), "broadcast"), [1, 2]).ok
    assert check_schedule(lambda n: Schedule("b", n, 1, (), "broadcast"), [1]).ok


def _tree_floor_log(n: int) -> Schedule:
    """Broken: ⌊log2 n⌋ levels instead of ⌈log2 n⌉ (towers past the last power of two)."""
    ticks = [tuple(Step(p, p + (1 << j), 0, "copy") for p in range(1 << j) if p + (1 << j) < n)
             for j in range(n.bit_length() - 1)]
    return Schedule("tree_floor", n, 1, tuple(ticks), "broadcast")


def _chain_unpipelined(n: int) -> Schedule:
    """Broken: every tower forwards chunk t at tick t, before it has arrived."""
    ticks = [tuple(Step(p, p + 1, t, "copy") for p in range(n - 1)) for t in range(2)]
    return Schedule("chain_eager", n, 2, tuple(ticks), "broadcast")


def _echo(n: int) -> Schedule:
    """Broken: the value is reduced back into the root, which already has it."""
    ticks = ((Step(0, 1, 0, "copy"),), (Step(1, 0, 0, "reduce"),)) if n > 1 else ()
    return Schedule("echo", n, 1, ticks, "broadcast")


@pytest.mark.parametrize(
    ("generator", "n", "tick", "words"),
    [(_tree_floor_log, 3, 1, "dropped chunk: tower 2"),
     (_chain_unpipelined, 3, 0, "send before receipt: tower 1"),
     (_echo, 2, 1, "double count")],
)
def test_broken_broadcasts_are_rejected_at_the_smallest_n(generator, n, tick, words) -> None:
    report = check_schedule(generator, range(1, 17))
    assert report.failure is not None
    assert (report.failure.n, report.failure.tick) == (n, tick), str(report)
    assert words in report.failure.message
    assert "REJECTED" in str(report)


def test_bad_arguments_name_what_was_expected() -> None:
    for generator in (ring_reduce_scatter, halving_reduce_scatter, doubling_all_gather,
                      binomial_broadcast, chain_broadcast):
        with pytest.raises(ValueError, match=re.escape("n (the tower count) must be an int >= 1")):
            generator(0)
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        chain_broadcast(4, chunks=0)
    with pytest.raises(ValueError, match="pieces must be an int >= 1"):
        even_sizes(4, 0)
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        even_sizes(-1, 2)
    with pytest.raises(ValueError, match="root must be a tower index in \\[0, 3\\)"):
        rooted(binomial_broadcast(3), 3)
    with pytest.raises(ValueError, match="rooted takes a broadcast schedule"):
        rooted(ring_all_gather(3), 0)
    with pytest.raises(ValueError, match="collective must be one of"):
        collective_algorithm("all_reduce", "ring")
    with pytest.raises(ValueError, match="algorithm must be one of doubling, ring for all_gather"):
        collective_algorithm("all_gather", "halving")
    with pytest.raises(ValueError, match="nbytes must be a multiple of itemsize"):
        schedule_bytes(ring_all_gather(2), 6, 4)


def test_trace_cli_prints_a_collectives_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    from towers import cli

    code = cli.main(["trace", "--collective", "reduce_scatter", "--algorithm", "halving",
                     "--towers", "4", "--size", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("reduce_scatter/halving on 4 towers: 2 ticks, summation depth 2")
    assert format_schedule(halving_reduce_scatter(4)) in out
    assert "bytes sent per tower for 32 bytes: [24, 24, 24, 24]" in out
    assert cli.main(["trace", "--collective", "broadcast", "--algorithm", "ring"]) == 2
    assert "algorithm must be one of chain, flat, tree for broadcast" in capsys.readouterr().err
