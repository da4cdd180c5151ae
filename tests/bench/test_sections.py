"""The cost-model section's fit, on all-reduce table rows of known origin."""

from __future__ import annotations

import numpy as np
import pytest

from towers.bench import costmodel
from towers.bench.costfit import fit_measured

SIZES = [4096 * 4**k for k in range(8)]  # the benchmark's: 4 KB ... 64 MB
LINK = costmodel.Link(alpha=1e-4, beta=1e-10, gamma=3e-10)


def _row(name: str, formula: str | None, nbytes: int, scale: float = 1.0) -> dict:
    seconds = costmodel.predict(formula or "naive", 4, nbytes, LINK) * scale
    return {"algorithm": name, "kind": "towers", "formula": formula, "params": {}, "n": 4,
            "size": nbytes, "time_us": seconds * 1e6}


def test_rows_the_model_made_give_back_its_constants() -> None:
    rows = [_row(name, formula, s) for name, formula in
            (("ring", "ring"), ("tf.ReductionToOneDevice", "naive")) for s in SIZES]
    rows += [_row("x", None, 4096), _row("send", "send", 4096)]  # unmodelled; calibration
    fitted = fit_measured(rows)
    assert [f["algorithm"] for f in fitted] == ["ring", "tf.ReductionToOneDevice"]
    assert [f["formula"] for f in fitted] == ["ring", "naive"]
    for f in fitted:
        assert f["alpha"] == pytest.approx(LINK.alpha, rel=1e-6)
        assert f["per_byte"] == pytest.approx(2 * LINK.beta + LINK.gamma, rel=1e-6)
        assert f["fit_max_error"] < 1e-6 and f["held_out_max_error"] < 1e-6


@pytest.mark.parametrize("seed", range(3))
def test_held_out_sizes_are_predicted_through_noise(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [_row("ring", "ring", s, 1 + 0.02 * rng.standard_normal()) for s in SIZES]
    [fitted] = fit_measured(rows)
    assert 0 < fitted["held_out_median_error"] <= fitted["held_out_max_error"] < 0.1


def test_rows_the_model_cannot_explain_show_in_the_error() -> None:
    """Times that grow with the square of the size: no α + S·β line follows them."""
    rows = [{**_row("odd", "ring", s), "time_us": 1.0 + (s / 4096) ** 2} for s in SIZES]
    [fitted] = fit_measured(rows)
    assert fitted["fit_max_error"] > 0.5 and fitted["held_out_max_error"] > 0.5


def test_one_size_is_fitted_but_nothing_is_held_out() -> None:
    [fitted] = fit_measured([_row("ring", "ring", 4096)])
    assert fitted["fit_max_error"] < 1e-6
    assert fitted["held_out_median_error"] is None and fitted["held_out_max_error"] is None
