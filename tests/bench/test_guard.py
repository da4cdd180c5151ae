"""The exactness table: the guard's and the barrier's shares, and their targets (the timing
itself is a benchmark, never a test)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.conftest import DEVICES
from towers.bench.guard import _trainer, guard_table
from towers.bench.targets import GUARD_SHARE, _guard_targets
from towers.bench.training import make_batch


def _row(mode: str, form: str, ms: float, share: float, barrier: float,
         vs_css: float) -> dict[str, Any]:  # fmt: skip
    return {"model": "mlp", "config": "towers naive/parameter_device", "on_nonfinite": mode,
            "update": form, "ms": ms, "share": share, "barrier": barrier, "vs_css": vs_css}


ROWS = [
    {"model": "mlp", "config": "CentralStorageStrategy", "on_nonfinite": "", "update": "",
     "ms": 42.9, "share": None, "barrier": None, "vs_css": 1.0},
    _row("skip", "nested", 44.4, 0.035, 0.002, 1.041),
    _row("ignore", "nested", 43.8, 0.0, 0.018, 1.023),
    _row("skip", "inlined", 44.1, 0.021, 0.0, 1.032),
    _row("ignore", "inlined", 43.4, 0.0, 0.0, 1.011),
]


def test_the_table_shows_both_shares_and_the_ratio_to_central_storage() -> None:
    text = guard_table(ROWS).splitlines()
    assert text[0].split()[-5:] == ["guard", "share", "barrier", "x", "CSS"]
    assert text[1].split()[-4:] == ["42.9", "-", "-", "1.000"]
    assert text[2].split()[-5:] == ["nested", "44.4", "+3.5%", "+0.2%", "1.041"]
    assert text[5].split()[-5:] == ["inlined", "43.4", "+0.0%", "+0.0%", "1.011"]


def test_the_guard_target_reads_the_default_step_and_names_the_barrier() -> None:
    (target,) = _guard_targets(ROWS)  # one per (model, config): the nested skip row
    assert target["value"] == pytest.approx(3.5) and target["limit"] == GUARD_SHARE == 2.0  # %
    assert target["target"] == ("mlp: the guard's share (%) of towers naive/parameter_device"
                                " <= 2.00")
    assert not target["holds"]
    assert "1.041 x CSS" in target["detail"] and "barrier +0.2%" in target["detail"]
    assert "without both 1.011 x CSS" in target["detail"]
    rows = [dict(r, share=0.015) if r["update"] == "nested" and r["on_nonfinite"] == "skip"
            else r for r in ROWS]  # fmt: skip
    assert _guard_targets(rows)[0]["holds"]


def test_the_inlined_calibration_trains_like_the_default_step_but_has_no_call() -> None:
    """Same model, same batch: the inlined update only loses its barrier (its sums may be
    reordered by Grappler: agreement within float32 rounding, not bitwise)."""
    x, y = make_batch("mlp", 16)
    trainers = [_trainer("mlp", DEVICES[:3], "naive", "parameter_device", "skip", form)
                for form in ("nested", "inlined")]  # fmt: skip
    losses = [[float(t.train_step(x, y)) for _ in range(2)] for t in trainers]
    assert losses[0][0] == losses[1][0]  # the first loss precedes any update
    np.testing.assert_allclose(losses[0][1], losses[1][1], rtol=1e-5)  # after one update
    for t, calls in zip(trainers, (1, 0)):
        graph = t.compiled.steps[False].get_concrete_function(*t._inputs(x, y, None)).graph
        found = [op for op in graph.get_operations()
                 if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
        assert len(found) == calls


def test_guard_rounds_are_raised_to_resolve_a_small_share() -> None:
    from argparse import Namespace

    from towers.bench.guard import GUARD_ROUNDS, guard_rounds

    assert guard_rounds(Namespace(quick=False, step_rounds=None)) == GUARD_ROUNDS
    assert guard_rounds(Namespace(quick=False, step_rounds=13)) == GUARD_ROUNDS
    assert guard_rounds(Namespace(quick=False, step_rounds=99)) == 99
    assert guard_rounds(Namespace(quick=True, step_rounds=None)) == 5
