"""The op-count table: traced ops beside the schedule's messages and chunk steps."""

from towers.bench.opcount import opcount_rows


def test_opcount_rows_follow_the_schedule() -> None:
    rows = opcount_rows(("halving_doubling", "ring"), (2, 4))
    assert [(r["algorithm"], r["n"]) for r in rows] == [
        ("halving_doubling", 2), ("halving_doubling", 4), ("ring", 2), ("ring", 4)]
    ring4 = rows[-1]
    assert ring4["messages"] == ring4["steps"] == 2 * 3 * 4  # one chunk per message
    hd4 = rows[1]
    assert hd4["messages"] < hd4["steps"]  # halving-doubling sends several chunks at once
    assert all(r["ops"] > r["messages"] and r["ops_per_message"] > 1 for r in rows)
