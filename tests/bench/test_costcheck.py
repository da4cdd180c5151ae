"""The cost-model check: in-sample fit and held-out prediction, on rows of known origin."""

from __future__ import annotations

import numpy as np
import pytest

from towers.bench import costmodel
from towers.bench.costcheck import TOLERANCE, check_cost_model, split_sizes

SIZES = [4096 * 4**k for k in range(8)]  # the benchmark's: 4 KB ... 64 MB
LINK = costmodel.Link(alpha=1e-4, beta=1e-10, gamma=3e-10)


def _row(name: str, formula: str, nbytes: int, link: costmodel.Link, scale: float = 1.0) -> dict:
    seconds = costmodel.predict(formula, 4, nbytes, link) * scale
    return {"algorithm": name, "kind": "towers", "formula": formula, "params": {}, "n": 4,
            "size": nbytes, "time_us": seconds * 1e6}


def test_exact_rows_fit_within_tolerance() -> None:
    rows = [_row("ring", "ring", s, LINK) for s in (4096, 1 << 16, 1 << 20, 1 << 24)]
    rows += [_row("tf.ReductionToOneDevice", "naive", s, LINK) for s in (4096, 1 << 20, 1 << 24)]
    rows.append({**_row("x", "naive", 4096, LINK), "formula": None})  # unmodelled: skipped
    details, summary = check_cost_model(rows)
    assert [s["algorithm"] for s in summary] == ["ring", "tf.ReductionToOneDevice"]
    assert all(s["ok"] and s["max_abs_error"] < 0.01 for s in summary)
    assert len(details) == 7
    assert summary[0]["per_byte"] == pytest.approx(2 * LINK.beta + LINK.gamma)


def _noisy(noise: float, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [_row(name, formula, s, LINK, 1 + noise * rng.standard_normal())
            for name, formula in (("ring", "ring"), ("tree", "tree"), ("naive", "naive"))
            for s in SIZES]


def test_the_training_sizes_are_named_and_shared() -> None:
    splits = split_sizes(_noisy(0.0))
    assert splits["interleaved"] == (SIZES[::2], SIZES[1::2])
    assert splits["extrapolated"] == (SIZES[:4], SIZES[4:])
    details, _ = check_cost_model(_noisy(0.0))
    for how, (train, _) in splits.items():
        assert [d[f"{how}_train"] for d in details] == [d["nbytes"] in train for d in details]


@pytest.mark.parametrize("seed", range(4))
def test_rows_the_model_generated_are_predicted_on_held_out_sizes(seed: int) -> None:
    _, summary = check_cost_model(_noisy(0.02, seed))
    for s in summary:
        assert s["interleaved_ok"] and s["interleaved_max_abs_error"] < 0.1, s["algorithm"]
        assert s["interleaved_median_abs_error"] <= s["interleaved_max_abs_error"]
    # Extrapolating amplifies noise: at <= 256 KB the per-byte term is a small part of
    # the time, so its slope is loosely pinned. With 0.5 % noise it still predicts 64 MB.
    _, summary = check_cost_model(_noisy(0.005, seed))
    assert all(s["extrapolated_ok"] and s["extrapolated_max_abs_error"] < 0.1 for s in summary)


def test_rows_the_model_cannot_explain_fail_held_out() -> None:
    # A cache cliff: from 1 MB up every byte costs twice as much. The in-sample fit
    # bends its one slope between the two and passes; fitted on the small half the
    # model never sees the cliff and predicts the large half far too fast.
    slow = costmodel.Link(LINK.alpha, 2 * LINK.beta, 2 * LINK.gamma)
    rows = [_row("ring", "ring", s, LINK if s < 1 << 20 else slow) for s in SIZES]
    details, [s] = check_cost_model(rows)
    assert s["ok"] and s["max_abs_error"] < 0.15
    assert not s["extrapolated_ok"] and s["extrapolated_max_abs_error"] > 0.4
    held = [d for d in details if not d["extrapolated_train"]]
    assert len(held) == 4 and all(d["extrapolated_error"] < -0.25 for d in held)  # too fast
    # Time growing as S^1.5: no α + S·(2β + γ) follows it, held out or not.
    rows = [{**_row("ring", "ring", s, LINK), "time_us": 1e-6 * s**1.5 / 1e3} for s in SIZES]
    _, [s] = check_cost_model(rows)
    assert not s["ok"] and not s["interleaved_ok"] and not s["extrapolated_ok"]
    assert s["interleaved_max_abs_error"] > TOLERANCE


def test_too_few_sizes_to_hold_out_gives_none() -> None:
    details, [s] = check_cost_model([_row("ring", "ring", s, LINK) for s in SIZES[:2]])
    assert s["ok"] and s["interleaved_ok"] is None and s["interleaved_max_abs_error"] is None
    assert details[0]["interleaved_error"] is None


def test_the_section_prints_and_saves_both_fits_and_the_training_sizes(tmp_path, capsys) -> None:
    import argparse
    import csv
    import json

    from towers.bench import sections, targets

    results: dict = {"allreduce": _noisy(0.0)}
    assert sections.costmodel_section(argparse.Namespace(out=tmp_path), [], results)
    text = capsys.readouterr().out
    train, held = split_sizes(results["allreduce"])["interleaved"]
    assert f"interleaved: fitted on {', '.join(map(str, train))} B only" in text
    assert f"predicts {', '.join(map(str, held))} B" in text
    assert "fit all" in text and "extrapolated" in text
    with (tmp_path / "costmodel.csv").open() as f:
        saved = list(csv.DictReader(f))
    assert len(saved) == 3 * len(SIZES)
    assert [r["interleaved_train"] for r in saved[:3]] == ["True", "False", "True"]
    assert float(saved[1]["interleaved_error"]) == pytest.approx(0, abs=1e-6)
    assert results["costmodel_splits"]["extrapolated"] == {"train": SIZES[:4],
                                                          "held_out": SIZES[4:]}
    assert json.dumps(results["costmodel"])  # bench.json can hold it
    [target, *_] = targets.targets(results)
    assert target["target"] == "cost model predicts held-out sizes within 25% for ring"
    assert target["holds"]
    assert target["value"] == results["costmodel"][0]["interleaved_max_abs_error"]


def test_the_target_falls_back_to_the_in_sample_fit_without_held_out_sizes() -> None:
    from towers.bench import targets

    _, summary = check_cost_model([_row("ring", "ring", s, LINK) for s in SIZES[:2]])
    [target] = targets.targets({"costmodel": summary})
    assert target["target"].endswith("(in-sample only)") and target["holds"]
