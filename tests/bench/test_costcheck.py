"""The cost-model check recovers a model the rows follow exactly."""

from __future__ import annotations

import pytest

from towers.bench import costmodel
from towers.bench.costcheck import check_cost_model


def _row(name: str, formula: str, nbytes: int, link: costmodel.Link) -> dict:
    seconds = costmodel.predict(formula, 4, nbytes, link)
    return {"algorithm": name, "kind": "towers", "formula": formula, "params": {}, "n": 4,
            "size": nbytes, "time_us": seconds * 1e6}


def test_exact_rows_fit_within_tolerance() -> None:
    link = costmodel.Link(alpha=1e-4, beta=1e-10, gamma=3e-10)
    rows = [_row("ring", "ring", s, link) for s in (4096, 1 << 16, 1 << 20, 1 << 24)]
    rows += [_row("tf.ReductionToOneDevice", "naive", s, link) for s in (4096, 1 << 20, 1 << 24)]
    rows.append({**_row("x", "naive", 4096, link), "formula": None})  # unmodelled: skipped
    details, summary = check_cost_model(rows)
    assert [s["algorithm"] for s in summary] == ["ring", "tf.ReductionToOneDevice"]
    assert all(s["ok"] and s["max_abs_error"] < 0.01 for s in summary)
    assert len(details) == 7
    assert summary[0]["per_byte"] == pytest.approx(2 * link.beta + link.gamma)
