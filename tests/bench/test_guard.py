"""The guard's share table (the timing itself is a benchmark, never a test)."""

from towers.bench.guard import guard_table


def test_guard_table_shows_the_share_per_mode() -> None:
    rows = [{"model": "mlp", "config": "towers naive/parameter_device", "on_nonfinite": m,
             "ms": ms, "share": share} for m, ms, share in (("skip", 34.2, 0.035),
                                                            ("ignore", 33.0, 0.0))]
    text = guard_table(rows).splitlines()
    assert "guard share" in text[0]
    assert text[1].split()[-2:] == ["34.2", "+3.5%"] and text[2].split()[-1] == "+0.0%"


def test_guard_rounds_are_raised_to_resolve_a_small_share() -> None:
    from argparse import Namespace

    from towers.bench.guard import GUARD_ROUNDS, guard_rounds

    assert guard_rounds(Namespace(quick=False, step_rounds=None)) == GUARD_ROUNDS
    assert guard_rounds(Namespace(quick=False, step_rounds=13)) == GUARD_ROUNDS
    assert guard_rounds(Namespace(quick=False, step_rounds=99)) == 99
    assert guard_rounds(Namespace(quick=True, step_rounds=None)) == 5
