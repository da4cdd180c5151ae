"""Interleaved timing: every configuration gets one sample per round, in shuffled order."""

from __future__ import annotations

import pytest

from towers.bench.timing import Samples, interleave, load_average, paired_ratio


def test_interleave_samples_every_function_each_round() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    out = interleave(fns, rounds=4, calls=2, warmup=1)
    assert set(out) == {"a", "b", "c"}
    assert all(len(s.wall) == 4 and len(s.cpu) == 4 for s in out.values())
    assert len(calls) == 3 * (1 + 4 * 2)
    rounds = [calls[3 + 6 * r: 3 + 6 * (r + 1)] for r in range(4)]
    assert all(sorted(set(r)) == ["a", "b", "c"] for r in rounds)


def test_calls_per_sample_can_differ_per_function() -> None:
    counts = {"a": 0, "b": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    interleave({k: (lambda k=k: bump(k)) for k in counts}, rounds=2, calls={"a": 3}, warmup=0)
    assert counts == {"a": 6, "b": 2}


def test_interleave_rejects_zero_rounds() -> None:
    with pytest.raises(ValueError, match="rounds"):
        interleave({"a": lambda: None}, rounds=0)


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    a = Samples(wall=[2.0, 4.0, 9.0], cpu=[0, 0, 0])
    b = Samples(wall=[1.0, 2.0, 3.0], cpu=[0, 0, 0])
    assert paired_ratio(a, b) == 2.0
    assert a.median == 4.0 and a.minimum == 2.0


def test_load_average_has_three_numbers() -> None:
    assert len(load_average()) == 3
