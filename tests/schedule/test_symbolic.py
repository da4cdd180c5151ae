"""The symbolic checker: the ring proved for n = 1..64, three classic bugs caught where they bite.

Each broken generator is a small edit of the ring (or the textbook dissemination
pattern); the checker must name the smallest failing tower count and the first tick
that breaks, and draw the state there. No TensorFlow runs here.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter

import pytest

from towers.schedule import (
    Schedule,
    ScheduleError,
    Step,
    bytes_sent,
    check_schedule,
    cost,
    format_schedule,
    ring_schedule,
    simulate,
    summation_depth,
)


def _ring_ticks(n: int, gather_ticks: int, overlap: int = 0) -> tuple[tuple[Step, ...], ...]:
    scatter = [[Step(p, (p + 1) % n, (p - 1 - t) % n, "reduce") for p in range(n)]
               for t in range(n - 1)]
    ticks = scatter + [[] for _ in range(gather_ticks)]
    for t in range(gather_ticks):  # the all-gather starts `overlap` ticks early
        ticks[n - 1 - overlap + t] += [Step(p, (p + 1) % n, (p - t) % n, "copy")
                                       for p in range(n)]
    return tuple(tuple(tick) for tick in ticks if tick or n == 1)


def ring_dropping_a_tick(n: int) -> Schedule:
    """Dropped chunk: the all-gather runs max(1, n-2) ticks, one short from n = 3 on."""
    return Schedule("ring_dropping_a_tick", n, n, _ring_ticks(n, max(1, n - 2) if n > 1 else 0))


def dissemination(n: int) -> Schedule:
    """Double count: recursive doubling by shifts (receive from i - 2^k), fine only for 2^k."""
    ticks, d = [], 1
    while d < n:
        ticks.append(tuple(Step((i - d) % n, i, 0, "reduce") for i in range(n)))
        d *= 2
    return Schedule("dissemination", n, 1, tuple(ticks))


def ring_gathering_early(n: int) -> Schedule:
    """Send before receipt: the all-gather starts in the last reduce-scatter tick."""
    return Schedule("ring_gathering_early", n, n, _ring_ticks(n, n - 1, overlap=1 if n > 1 else 0))


def test_the_ring_is_proved_for_every_n_up_to_64() -> None:
    start = time.perf_counter()
    report = check_schedule(ring_schedule)
    elapsed = time.perf_counter() - start
    assert report.ok, report
    assert report.ns == tuple(range(1, 65))
    assert report.depths == {n: n - 1 for n in range(1, 65)}
    assert str(report).startswith("PROVED: ring for 64 tower counts (n=1..64)")
    assert elapsed < 30  # measured about 1 s on 2 shared cores


def test_a_dropped_chunk_is_found_at_the_end_with_the_smallest_n() -> None:
    report = check_schedule(ring_dropping_a_tick)
    assert not report.ok and report.failure is not None
    # 2 scatter + 1 gather ticks (0, 1, 2): the end state is the state after tick 2
    assert (report.failure.n, report.failure.tick, report.failure.end) == (3, 3, True)
    assert report.failure.message == "dropped chunk: tower 2 ends with chunk 0 missing 0"
    assert "held after tick 2, the last" in report.failure.drawing
    assert "REJECTED: ring_dropping_a_tick: smallest failing n=3, after tick 2 (the end)" in str(
        report)
    assert "tick 3" not in str(report)  # there is no tick 3


def test_a_double_count_is_found_at_its_tick() -> None:
    report = check_schedule(dissemination)
    assert report.failure is not None
    assert (report.failure.n, report.failure.tick) == (3, 1)
    assert report.failure.message == (
        "double count: tower 1 reduces chunk 0 into tower 0, which already has 0")
    assert "✗ 1 ─c0+▶ 0" in report.failure.drawing
    assert "held after tick 0, when tick 1 begins" in report.failure.drawing


def test_four_towers_of_dissemination_disagree_bitwise() -> None:
    """At n = 4 every contribution arrives once, but towers sum in different orders."""
    with pytest.raises(ScheduleError, match="different orders") as caught:
        simulate(dissemination(4))
    assert caught.value.end and str(caught.value).startswith("after tick 1 (the end): ")
    # both orders shown, each pair smaller tower first
    assert caught.value.message.endswith(
        "tower 0 sums (0+3)+(1+2), tower 1 sums (0+1)+(2+3)")
    assert check_schedule(dissemination, [1, 2]).ok


def test_a_send_before_receipt_is_found_at_its_tick() -> None:
    report = check_schedule(ring_gathering_early)
    assert report.failure is not None
    assert (report.failure.n, report.failure.tick) == (2, 0)
    assert report.failure.message.startswith(
        "send before receipt: tower 0 copies chunk 0 to tower 1 but does not hold it complete "
        "(only 0)")
    drawing = report.failure.drawing.splitlines()
    assert drawing[0] == "ring_gathering_early, n=2: contributions held when tick 0 begins (· none)"
    assert drawing[2].split() == ["tower", "0", "0", "0"]
    assert "✗ 0 ─c0▶ 1" in drawing[-1]


def test_rules_on_single_steps() -> None:
    def one(step: Step, chunks: int = 1) -> Schedule:
        return Schedule("one", 2, chunks, ((step,),))

    for step, message in [
        (Step(0, 2, 0, "copy"), "out of range"),
        (Step(1, 1, 0, "reduce"), "sends chunk 0 to itself"),
        (Step(0, 1, 0, "copy"), "send before receipt"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            simulate(one(step))
    with pytest.raises(ScheduleError, match="tick 2: two writes to tower 0's chunk 0"):
        simulate(Schedule("two", 3, 1, ((Step(0, 1, 0, "reduce"),), (Step(2, 1, 0, "reduce"),),
                                        (Step(2, 0, 0, "reduce"), Step(1, 0, 0, "copy")))))
    with pytest.raises(ValueError, match="kind"):
        Schedule("bad", 2, 1, ((Step(0, 1, 0, "add"),),))


def test_a_generator_that_fails_is_reported() -> None:
    def wrong_size(n: int) -> Schedule:
        return ring_schedule(n + 1) if n == 5 else ring_schedule(n)

    report = check_schedule(wrong_size, range(1, 9))
    assert report.failure is not None and report.failure.n == 5 and report.failure.tick is None
    assert "asked for 5 towers" in str(report)


def test_reduce_scatter_and_all_gather_semantics() -> None:
    def scatter(n: int) -> Schedule:
        ring = ring_schedule(n)
        return Schedule("scatter", n, n, ring.ticks[: n - 1], "reduce_scatter")

    def gather(n: int) -> Schedule:
        ring = ring_schedule(n)
        return Schedule("gather", n, n, ring.ticks[n - 1 :], "all_gather")

    assert check_schedule(scatter, range(1, 17)).ok
    assert check_schedule(gather, range(1, 17)).ok
    broken = check_schedule(lambda n: Schedule("g", n, n, ring_schedule(n).ticks[n:],
                                                "all_gather"), range(1, 9))
    assert broken.failure is not None and broken.failure.n == 2


def test_quantities_derived_from_the_schedule_match_the_ring_module() -> None:
    ring_module = importlib.import_module("towers.allreduce.ring")  # `ring` is the factory

    for n in range(1, 9):
        s = ring_schedule(n)
        assert bytes_sent(s, 4 * 37, 4) == [2 * (n - 1) * -(-37 // n) * 4] * n  # padded chunks
        assert cost(s, 1000.0) == pytest.approx(ring_module.cost(n, 1000.0))
        assert summation_depth(s) == max(n - 1, 0)
        for subchunks in (2, 3):  # s rings side by side: as many ticks, s chunks a tick
            rings = ring_schedule(n, subchunks)
            assert rings.num_ticks == s.num_ticks and summation_depth(rings) == max(n - 1, 0)
            assert bytes_sent(rings, 4 * 37, 4) == [
                2 * (n - 1) * subchunks * -(-37 // (n * subchunks)) * 4] * n
    links = Counter((step.src, step.dst) for _, step in ring_schedule(3).steps())
    assert links == {(0, 1): 4, (1, 2): 4, (2, 0): 4}  # each tower sends only to its right
    drawn = format_schedule(ring_schedule(4)).splitlines()
    assert drawn[1].split() == ["tower", "0", "c3+▶1", "c2+▶1", "c1+▶1", "c0", "▶1", "c3", "▶1",
                                "c2", "▶1"]
