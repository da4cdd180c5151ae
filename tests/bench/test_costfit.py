"""Held-out prediction: what a fit on some sizes predicts at the others."""

from __future__ import annotations

import pytest

from towers.bench import costfit
from towers.bench.costmodel import Link, predict

# Ring and tree rows fix only α and 2β + γ: fit says so, and that is all these tests need.
pytestmark = pytest.mark.filterwarnings("ignore:fit .*do not determine")

LINK = Link(alpha=20e-6, beta=1 / 8e9, gamma=1 / 2e9)


def _rows(algorithms=("ring", "tree"), sizes=(1e3, 1e4, 1e5, 1e6, 1e7), link=LINK) -> list:
    return [{"algorithm": a, "n": 8, "nbytes": s, "seconds": predict(a, 8, s, link)}
            for a in algorithms for s in sizes]


def test_holdout_predicts_unseen_sizes_of_rows_the_model_made():
    results = costfit.holdout(_rows(), {1e3, 1e5, 1e7})
    assert [(r["algorithm"], r["nbytes"], r["train"]) for r in results[:5]] == [
        ("ring", 1e3, True), ("ring", 1e4, False), ("ring", 1e5, True), ("ring", 1e6, False),
        ("ring", 1e7, True)]
    assert max(abs(r["rel_error"]) for r in results) < 1e-6


def test_holdout_fits_on_the_training_rows_only():
    # The held-out rows are 10x slower than the model: a fit that peeked would split the
    # difference; one that did not predicts them 90 % too fast and the training rows exactly.
    rows = [{**r, "seconds": r["seconds"] * (10 if r["nbytes"] == 1e4 else 1)} for r in _rows()]
    results = costfit.holdout(rows, {1e3, 1e5, 1e6, 1e7})
    for r in results:
        assert r["rel_error"] == pytest.approx(-0.9 if r["nbytes"] == 1e4 else 0.0, abs=1e-6)


def test_holdout_leaves_calibration_rows_out_of_the_results():
    rows = _rows(("ring", "send", "add"))
    results = costfit.holdout(rows, {1e3, 1e5, 1e7})
    assert {r["algorithm"] for r in results} == {"ring"}
    assert max(abs(r["rel_error"]) for r in results) < 1e-6


def test_holdout_needs_every_algorithm_at_a_training_size():
    rows = _rows(("ring",)) + _rows(("tree",), sizes=(1e4,))
    with pytest.raises(ValueError, match="tree"):
        costfit.holdout(rows, {1e3, 1e5})
