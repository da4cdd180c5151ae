"""Scaling rows and growth exponents on a few towers."""

from __future__ import annotations

from tests.conftest import DEVICES
from towers.bench.scaling import fit_slopes, run_scaling


def test_graph_grows_with_towers_and_buckets() -> None:
    rows = run_scaling(DEVICES[:4], towers=(2, 4), depths=(1, 2), algorithms=["naive", "ring"])
    assert len(rows) == 8 and not any(r["error"] for r in rows)
    naive = {(r["towers"], r["buckets"]): r["ops"] for r in rows if r["algorithm"] == "naive"}
    assert naive[(4, 6)] > naive[(2, 6)] and naive[(4, 6)] > naive[(4, 4)]
    slopes = {s["algorithm"]: s for s in fit_slopes(rows)}
    assert slopes["naive"]["linear"]
    assert slopes["ring"]["towers_exponent"] > slopes["naive"]["towers_exponent"]
    assert all(r["trace_s"] > 0 and r["sends"] > 0 for r in rows)
